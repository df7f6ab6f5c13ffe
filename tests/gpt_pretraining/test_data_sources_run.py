"""pretrain_gpt.py's data sources: --mock-data with no dataset (a few finite, repeatable
iterations), and a read-only dataset directory with or without --data-cache-path."""

from __future__ import annotations

import math
import os

import pretrain_gpt
from tests.data.read_only import read_only
from tests.sample_data import copy_dataset
from tests.tiny_gpt import run_expecting_error, tiny_gpt_args


def mock_data_args(*extra: str) -> list[str]:
    """tiny_gpt_args with --mock-data in place of --data-path."""
    args = tiny_gpt_args("unused", *extra, train_iters=4, seq_length=32, eval_interval=2)
    at = args.index("--data-path")
    return args[:at] + args[at + 2 :] + ["--mock-data"]


def test_mock_data_trains_without_a_dataset_and_repeats():
    first = pretrain_gpt.main(mock_data_args())
    losses = [step["lm loss"] for step in first.losses]
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses), losses
    assert first.validation and all(
        math.isfinite(values["lm loss"]) for _, values in first.validation
    )
    second = pretrain_gpt.main(mock_data_args())
    assert [step["lm loss"] for step in second.losses] == losses
    assert second.validation == first.validation


def test_mock_data_trains_with_megatron_cores_null_tokenizer():
    # No tokenizer file at all: --vocab-size 512 ids, the last the end of each mock document.
    # The GPT-2 files mock_data_args names are not read, as in Megatron-Core.
    null = ("--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--train-iters", "3")
    losses = [step["lm loss"] for step in pretrain_gpt.main(mock_data_args(*null)).losses]
    # The first loss is about ln(512) = 6.2 (GPT-2's padded 50304 would give about 10.8).
    assert len(losses) == 3 and 5.5 < losses[0] < 7.0, losses


def test_read_only_dataset_trains_with_a_data_cache_path(sample_prefix, tmp_path, monkeypatch):
    data_dir, cache_dir = tmp_path / "data", tmp_path / "cache"
    data_dir.mkdir()
    prefix = copy_dataset(sample_prefix, str(data_dir / "owt_text_document"))
    args = tiny_gpt_args(prefix, train_iters=3, seq_length=32, eval_interval=3)
    with read_only(data_dir, monkeypatch):
        result = pretrain_gpt.main(args + ["--data-cache-path", str(cache_dir)])
    assert len(result.losses) == 3
    assert sorted(os.listdir(data_dir)) == ["owt_text_document.bin", "owt_text_document.idx"]
    cached = sorted(os.listdir(cache_dir))
    assert len(cached) == 12 and all(name.startswith("owt_text_document_") for name in cached)


def test_read_only_dataset_without_a_data_cache_path_is_one_line(
    sample_prefix, tmp_path, monkeypatch, capsys
):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    prefix = copy_dataset(sample_prefix, str(data_dir / "owt_text_document"))
    with read_only(data_dir, monkeypatch):
        error = run_expecting_error(tiny_gpt_args(prefix, train_iters=3), capsys)
    assert error.startswith(f"error: {prefix} (train split): cannot write the index cache ")
    assert error.endswith(
        f" beside the data in {data_dir} (Permission denied): give --data-cache-path DIR, a "
        "directory global rank 0 can write and every rank can read"
    )
