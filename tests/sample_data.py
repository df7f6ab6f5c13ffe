"""The bundled sample corpus and GPT-2 vocabulary, and the preprocessing command line tests share."""

import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "data" / "sample"
CORPUS = SAMPLE / "openwebtext-1000.jsonl.xz"
VOCAB = SAMPLE / "gpt2-vocab.json"
MERGES = SAMPLE / "gpt2-merges.txt"
EOD = 50256


def gpt2_preprocess_args(input_path, output_prefix, *extra, workers=2):
    """tools/preprocess_data.py flags for GPT-2 BPE with --append-eod, then `extra`."""
    return [
        "--input", str(input_path), "--output-prefix", str(output_prefix),
        "--vocab-file", str(VOCAB), "--merge-file", str(MERGES),
        "--tokenizer-type", "GPT2BPETokenizer", "--append-eod", "--workers", str(workers),
        *extra,
    ]  # fmt: skip


def copy_dataset(prefix: str, new_prefix: str) -> str:
    """Copy the indexed dataset `prefix` (.bin and .idx, not its index caches) to `new_prefix`."""
    for suffix in (".bin", ".idx"):
        shutil.copyfile(prefix + suffix, new_prefix + suffix)
    return new_prefix
