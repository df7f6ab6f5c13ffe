"""pretrain_gpt.py with --mock-data and no dataset: a few finite, repeatable iterations."""

from __future__ import annotations

import math

import pretrain_gpt
from tests.tiny_gpt import tiny_gpt_args


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
