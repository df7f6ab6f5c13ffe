"""How closely exported Hugging Face models follow the checkpoints they came from, on real text.

For each checkpoint: export it (tools/checkpoint/convert.py), load the export with
`transformers` in fp32, and run both models over documents of the bundled corpus; prints the
largest logit difference relative to the largest logit, and each model's language-model loss
(this project's over the tokenizer's vocabulary and over the padded one it trains with):

    python -m bench.export_fidelity runs/quickstart/checkpoints other/checkpoints ...
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import tempfile
from pathlib import Path

import torch

from gpt_pretraining.checkpoint_model import read_checkpoint_model
from gpt_pretraining.huggingface.hf_export import (
    TokenizerFiles,
    build_checkpoint_tokenizer,
    export_checkpoint,
)

CORPUS = Path(__file__).resolve().parents[1] / "data" / "sample" / "openwebtext-1000.jsonl.xz"


def documents(count: int):
    """The last `count` documents of the bundled corpus."""
    with lzma.open(CORPUS, "rt", encoding="utf-8") as handle:
        texts = [json.loads(line)["text"] for line in handle]
    return texts[-count:]


def compare(load_dir: str, count: int, length: int) -> dict:
    from transformers import AutoModelForCausalLM

    checkpoint = read_checkpoint_model(load_dir, print_fn=lambda _: None)
    tokenizer = build_checkpoint_tokenizer(checkpoint, TokenizerFiles())
    vocab = tokenizer.vocab_size
    ours = checkpoint.build_model()
    with tempfile.TemporaryDirectory() as directory:
        hf_dir = os.path.join(directory, "hf")
        architecture = export_checkpoint(load_dir, hf_dir, print_fn=lambda _: None)
        theirs = AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=torch.float32, trust_remote_code=True
        ).eval()
        worst, sums = 0.0, {"ours": 0.0, "ours_padded": 0.0, "theirs": 0.0}
        tokens_seen = 0
        for text in documents(count):
            ids = tokenizer.tokenize(text)[:length]
            tokens = torch.tensor([ids])
            with torch.no_grad():
                padded_logits = ours(tokens)
                logits = padded_logits[..., :vocab]
                output = theirs(tokens, labels=tokens)
            worst = max(worst, ((output.logits - logits).abs().max() / logits.abs().max()).item())
            labels = tokens[0, 1:]
            count_here = labels.numel()
            sums["ours"] += (
                torch.nn.functional.cross_entropy(logits[0, :-1], labels).item() * count_here
            )
            sums["ours_padded"] += (
                torch.nn.functional.cross_entropy(padded_logits[0, :-1], labels).item() * count_here
            )
            sums["theirs"] += output.loss.item() * count_here
            tokens_seen += count_here
    return {
        "checkpoint": load_dir,
        "class": architecture,
        "max |logit diff| / max |logit|": worst,
        **{f"loss {name}": value / tokens_seen for name, value in sums.items()},
        "tokens": tokens_seen,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--length", type=int, default=128, help="tokens per document (at most)")
    args = parser.parse_args()
    rows = [compare(path, args.documents, args.length) for path in args.checkpoints]
    header = "| checkpoint | class | max rel. logit diff | loss (ours, vocab) | loss (transformers) | |diff| | loss (ours, padded vocab) | tokens |"
    print(header)
    print("|" + "---|" * 8)
    for row in rows:
        difference = abs(row["loss ours"] - row["loss theirs"])
        print(
            f"| {row['checkpoint']} | {row['class']} | {row['max |logit diff| / max |logit|']:.2e} "
            f"| {row['loss ours']:.7f} | {row['loss theirs']:.7f} | {difference:.1e} "
            f"| {row['loss ours_padded']:.7f} | {row['tokens']} |"
        )


if __name__ == "__main__":
    main()
