"""The command lines the config tests build on: a small valid one, and MegaBlocks' 125M launch."""

from __future__ import annotations

import pytest

from megatron.config import Config, ConfigError, parse_config

# A small, valid command line; tests add or replace flags on top of it.
BASE = {
    "--num-layers": "2",
    "--hidden-size": "64",
    "--num-attention-heads": "4",
    "--seq-length": "32",
    "--max-position-embeddings": "32",
    "--micro-batch-size": "2",
    "--lr": "0.001",
    "--train-iters": "10",
    "--data-path": "corpus_text_document",
    "--vocab-file": "vocab.json",
    "--merge-file": "merges.txt",
}

MEGABLOCKS_125M = (
    "--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 "
    "--max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 512 "
    "--lr 0.0006 --min-lr 0.00006 --lr-decay-style cosine --lr-warmup-fraction 0.01 "
    "--clip-grad 1.0 --init-method-std 0.01 --bf16 --split 969,30,1 "
    "--make-vocab-size-divisible-by 1024 --train-iters 2000 --lr-decay-iters 2000 "
    "--data-path 1.0 pile/01_text_document 1.0 pile/02_text_document "
    "--vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt "
    "--DDP-impl local --no-async-tensor-model-parallel-allreduce --use-flash-attn "
    "--save-interval 2000 --save ./ckpt --eval-iters 100 --log-interval 100 --eval-interval 1000"
).split()


def argv(*extra: str, drop: tuple[str, ...] = (), **replace: str) -> list[str]:
    """BASE as an argv, without the flags in `drop`, with `replace` (flag_name=value) applied."""
    flags = {flag: value for flag, value in BASE.items() if flag not in drop}
    for name, value in replace.items():
        flags["--" + name.replace("_", "-")] = value
    out: list[str] = []
    for flag, value in flags.items():
        out += [flag, *value.split()]
    return out + list(extra)


def config(*extra: str, world_size: int = 1, **kwargs) -> Config:
    return parse_config(argv(*extra, **kwargs), world_size=world_size)


def error_message(*extra: str, world_size: int = 1, **kwargs) -> str:
    with pytest.raises(ConfigError) as raised:
        config(*extra, world_size=world_size, **kwargs)
    return str(raised.value)
