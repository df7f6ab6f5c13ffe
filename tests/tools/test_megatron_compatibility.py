"""Files written by upstream Megatron-LM read back here, and ours are byte-identical to them."""

import json
import lzma
from pathlib import Path

import numpy as np

from megatron.data import preprocess
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.tokenizer import build_tokenizer
from tests.sample_data import REPO, SAMPLE, gpt2_preprocess_args

MEGATRON_WRITTEN = REPO / "tests" / "fixtures" / "megatron_written" / "owt20_text_document"


def _first_documents(count):
    with lzma.open(SAMPLE / "openwebtext-1000.jsonl.xz", "rt", encoding="utf-8") as corpus:
        return [line for _, line in zip(range(count), corpus)]


def test_megatron_written_dataset_reads_back_to_the_source_texts():
    dataset = MMapIndexedDataset(str(MEGATRON_WRITTEN))
    tokenizer = build_tokenizer(
        "GPT2BPETokenizer",
        vocab_file=str(SAMPLE / "gpt2-vocab.json"),
        merge_file=str(SAMPLE / "gpt2-merges.txt"),
    )
    assert dataset.dtype == np.uint16
    assert len(dataset) == 20
    for index, line in enumerate(_first_documents(20)):
        tokens = dataset.get(index)
        assert tokens[-1] == tokenizer.eod
        assert tokenizer.detokenize(tokens[:-1].tolist()) == json.loads(line)["text"]


def test_our_preprocessing_writes_megatrons_bytes(tmp_path):
    source = tmp_path / "owt20.jsonl"
    source.write_text("".join(_first_documents(20)), encoding="utf-8")
    prefix = tmp_path / "owt20"
    args = gpt2_preprocess_args(source, prefix)
    assert preprocess.main(args) == 0
    for suffix in (".bin", ".idx"):
        ours = Path(f"{prefix}_text_document{suffix}").read_bytes()
        megatrons = Path(f"{MEGATRON_WRITTEN}{suffix}").read_bytes()
        assert ours == megatrons, suffix
