"""A diverged run stops before it saves (--check-for-nan-in-loss-and-grad, on by default), a
run told to train on counts its non-finite iterations and still never saves non-finite
weights, and a checkpoint loaded without checksums is checked for non-finite values."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import pretrain_gpt
from megatron.training.logging import format_validation_block
from tests.tiny_gpt import run_expecting_error, tiny_gpt_args

# A learning rate no model survives: iteration 1 is finite, its update makes iteration 2 NaN.
DIVERGING = ("--lr", "1e30", "--min-lr", "1e30", "--lr-warmup-iters", "0", "--clip-grad", "0")
NAN_COUNTS = re.compile(r"number of nan iterations: +(\d+)")


def _tracker(root: Path) -> int:
    return int((root / "latest_checkpointed_iteration.txt").read_text())


@pytest.mark.parametrize("saving", [[], ["--async-save"]])
def test_a_non_finite_loss_stops_the_run_before_it_saves(data_prefix, tmp_path, capsys, saving):
    """With --async-save the good checkpoint of iteration 1, still being written when
    iteration 2 diverges, completes."""
    save = tmp_path / "ckpt"
    args = tiny_gpt_args(
        data_prefix, *DIVERGING, "--save", str(save), "--save-interval", "1", *saving,
        train_iters=4,
    )  # fmt: skip
    error = run_expecting_error(args, capsys)
    assert error.startswith("error: iteration 2: lm loss is nan, the gradient norm is nan;")
    assert f"the last good checkpoint is {save / 'iter_0000001'}" in error
    assert "--no-check-for-nan-in-loss-and-grad" in error
    assert _tracker(save) == 1 and sorted(p.name for p in save.iterdir()) == [
        "iter_0000001",
        "latest_checkpointed_iteration.txt",
    ]


def test_training_on_counts_nan_iterations_and_never_saves_them(data_prefix, tmp_path, capsys):
    save = tmp_path / "ckpt"
    args = tiny_gpt_args(
        data_prefix, *DIVERGING, "--no-check-for-nan-in-loss-and-grad",
        "--save", str(save), "--save-interval", "3", "--eval-interval", "2",
        train_iters=4,
    )  # fmt: skip
    error = run_expecting_error(args, capsys)
    # Iterations 2 and 3 trained on NaN; the save of iteration 3 is refused.
    assert error.startswith("error: iteration 3: the weight ")
    assert "values NaN) is not finite, so it is not saved" in error
    assert "this run has saved no checkpoint yet" in error
    assert not save.exists() or not any(save.iterdir())


def test_nan_iterations_are_counted_and_get_no_perplexity(data_prefix, capsys):
    args = tiny_gpt_args(
        data_prefix, *DIVERGING, "--no-check-for-nan-in-loss-and-grad", "--eval-interval", "2",
        train_iters=3,
    )  # fmt: skip
    pretrain_gpt.main(args)
    output = capsys.readouterr().out
    assert [int(n) for n in NAN_COUNTS.findall(output)] == [0, 1, 1]
    assert "validation loss at iteration 2 | lm loss value: NAN | \n" in output
    assert "PPL" not in output.split("validation loss at iteration 2")[1].split("\n")[0]


def test_the_validation_block_has_no_perplexity_for_a_non_finite_loss():
    block = format_validation_block("iteration 2", {"lm loss": float("nan")})
    assert "lm loss value: NAN" in block and "PPL" not in block
    finite = format_validation_block("iteration 2", {"lm loss": 2.0})
    assert "lm loss PPL: 7.389056E+00" in finite


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch"])
def test_a_checkpoint_without_checksums_is_checked_for_non_finite_values(
    data_prefix, tmp_path, capsys, ckpt_format
):
    """The issue's case: checksums.json removed (as the message for an unreadable one
    suggests) and 64 KiB of a tensor file overwritten with 0xFF bytes (NaN as fp32)."""
    save = tmp_path / "ckpt"
    common = ("--ckpt-format", ckpt_format, "--save", str(save), "--save-interval", "2")
    pretrain_gpt.main(tiny_gpt_args(data_prefix, *common, "--exit-interval", "4", train_iters=6))
    directory = save / "iter_0000004"
    (directory / "checksums.json").unlink()
    tensors = max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    size = tensors.stat().st_size
    with open(tensors, "r+b") as file:
        file.seek(size // 2)
        file.write(b"\xff" * 65536)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.main(tiny_gpt_args(data_prefix, *common, "--load", str(save), train_iters=6))
    assert exit_info.value.code == 1
    said = capsys.readouterr()
    error = said.err.strip()
    assert error.startswith(f"error: {directory} (loaded without checksums) holds non-finite")
    assert "values NaN)" in error and "echo 2 > " in error and "\n" not in error
    assert f"note: {directory} has no checksums.json (though it was saved with one" in said.out
    assert _tracker(save) == 4 and not (save / "iter_0000006").exists()
