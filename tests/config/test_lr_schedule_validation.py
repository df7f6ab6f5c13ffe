"""The learning-rate schedule's flags (megatron/config/lr_schedule_validation.py): WSD's final
decay parses into the config, and each impossible combination is one line naming its flags."""

from __future__ import annotations

import pytest

from tests.config.command_lines import config, error_message


def test_wsd_flags_reach_the_optimizer_config():
    optimizer = config(
        *"--lr-decay-style WSD --lr-wsd-decay-style minus_sqrt --lr-wsd-decay-iters 4".split()
    ).optimizer
    assert (optimizer.lr_decay_style, optimizer.lr_wsd_decay_style) == ("WSD", "minus_sqrt")
    assert (optimizer.lr_wsd_decay_iters, optimizer.lr_decay_iters) == (4, 10)


def test_wsd_decay_style_defaults_to_megatron_cores_exponential():
    optimizer = config("--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "10").optimizer
    assert optimizer.lr_wsd_decay_style == "exponential"


@pytest.mark.parametrize(
    "extra, kwargs, expected",
    [
        (
            ("--lr-decay-style", "WSD"),
            {},
            "--lr-decay-style WSD needs the length of its final decay: add "
            "--lr-wsd-decay-iters N (the last N iters of --lr-decay-iters)",
        ),
        (
            ("--lr-decay-style", "WSD"),
            {"drop": ("--train-iters",), "train_samples": "100"},
            "--lr-decay-style WSD needs the length of its final decay: add "
            "--lr-wsd-decay-samples N (the last N samples of --lr-decay-samples)",
        ),
        (
            ("--lr-decay-style", "cosine", "--lr-wsd-decay-iters", "2"),
            {},
            "--lr-wsd-decay-iters 2 is the final decay of --lr-decay-style WSD, but "
            "--lr-decay-style is cosine: add --lr-decay-style WSD or drop --lr-wsd-decay-iters",
        ),
        (
            ("--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "11"),
            {},
            "--lr-wsd-decay-iters 11 is longer than the decay length --lr-decay-iters 10 "
            "(which defaults to --train-iters) that it ends: give at most 10",
        ),
        (
            ("--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "-1"),
            {},
            "--lr-wsd-decay-iters must be >= 0, got -1",
        ),
        (
            ("--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "10"),
            {},
            "--train-iters measures the run in iters, so the schedule must too: replace "
            "--lr-decay-samples/--lr-warmup-samples/--lr-wsd-decay-samples with "
            "--lr-decay-iters/--lr-warmup-iters/--lr-wsd-decay-iters",
        ),
    ],
)
def test_wsd_refusals(extra, kwargs, expected):
    assert error_message(*extra, **kwargs) == expected


def test_unknown_wsd_decay_style_is_refused():
    message = error_message("--lr-decay-style", "WSD", "--lr-wsd-decay-style", "square")
    assert "--lr-wsd-decay-style" in message and "'square'" in message
