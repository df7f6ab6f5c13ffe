"""bench/generation.py on the CPU (also where there is a GPU) at tiny sizes: it writes a random-weight checkpoint of an
example, times the engine, and beside it transformers' generate on the checkpoint's Hugging
Face export, which in fp32 picks the same greedy tokens."""

from __future__ import annotations

import re

import pytest

from bench import generation
from megatron.checkpointing.layout import read_tracker

TABLE_ROW = re.compile(
    r"^\| (megatron\.inference|transformers generate) \| (.+?) \| (\d+) \| ([0-9.]+) \| "
    r"([0-9,]+) \| (.*?) \| (.*?) \|$"
)


def table_rows(out: str):
    return [TABLE_ROW.match(line).groups() for line in out.splitlines() if TABLE_ROW.match(line)]


def test_tiny_dmoe_example_is_written_and_timed(tmp_path, capsys):
    load = str(tmp_path / "dmoe")
    argv = ["--example", "dmoe_125m", "--tiny", "--load", load, "--batch-sizes", "1", "3",
            "--tokens", "4", "--prompt-length", "5", "--repeats", "1", "--device", "cpu"]  # fmt: skip
    generation.main(argv)
    assert read_tracker(load) == 1
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert [(row[0], row[1], row[2]) for row in rows] == [
        ("megatron.inference", "eager", "1"),
        ("megatron.inference", "eager", "3"),
    ]
    assert "command: python -m bench.generation --example dmoe_125m --tiny" in out


def test_tiny_gpt2_against_its_transformers_export(tmp_path, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    load, hf_dir = str(tmp_path / "gpt2"), str(tmp_path / "gpt2_hf")
    argv = ["--example", "gpt2_125m", "--tiny", "--load", load, "--export-hf", hf_dir,
            "--batch-sizes", "2", "--tokens", "6", "--prompt-length", "5", "--repeats", "1",
            "--device", "cpu"]  # fmt: skip
    generation.main(argv)
    rows = table_rows(capsys.readouterr().out)
    assert [row[0] for row in rows] == ["megatron.inference", "transformers generate"]
    assert rows[0][5].endswith("x")  # our speed relative to transformers'
    assert rows[1][6] == "6.0 / 6"  # fp32: every greedy token agrees
