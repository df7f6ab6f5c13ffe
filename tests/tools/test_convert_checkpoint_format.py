"""tools/convert_checkpoint_format.py: torch -> torch_dist -> torch gives back the same file's
contents bit for bit (a dMoE GPT, whose router buffers are not optimizer parameters), and the
converted checkpoint resumes the run as the original does."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

import pretrain_gpt
from gpt_pretraining.checkpoint_format import main as convert
from megatron.checkpointing import convert as checkpoint_convert
from tests.tiny_gpt import MOE_ARGS, saved_state, tiny_gpt_args

BIAS = ("--moe-router-bias-update-rate", "0.01")  # a persistent buffer that changes


def assert_identical(expected, actual, where="state"):
    """Equal nested state: tensors bit for bit (dtype included), everything else by ==."""
    if torch.is_tensor(expected):
        assert torch.is_tensor(actual) and expected.dtype == actual.dtype, where
        assert torch.equal(expected, actual), where
    elif isinstance(expected, dict):
        assert list(expected) == list(actual), (where, list(expected), list(actual))
        for key in expected:
            assert_identical(expected[key], actual[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual), where
        for index, (left, right) in enumerate(zip(expected, actual)):
            assert_identical(left, right, f"{where}[{index}]")
    elif isinstance(expected, np.ndarray):
        assert np.array_equal(expected, actual) and expected.dtype == actual.dtype, where
    elif hasattr(expected, "__dict__") and not isinstance(expected, type):
        assert_identical(vars(expected), vars(actual), where)
    else:
        assert expected == actual, where


@pytest.fixture(scope="module")
def torch_run(data_prefix, tmp_path_factory):
    directory = tmp_path_factory.mktemp("convert")
    args = tiny_gpt_args(
        data_prefix, *MOE_ARGS, *BIAS, "--save", str(directory / "torch"), "--save-interval", "3",
        "--ckpt-format", "torch", train_iters=5,
    )  # fmt: skip
    result = pretrain_gpt.main(args)
    return directory, args, result


def test_round_trip_is_bit_exact(torch_run, capsys, monkeypatch):
    directory, _, _ = torch_run
    # The whole-tensor read in many batches (each a progress step), as for a large model.
    monkeypatch.setattr(checkpoint_convert, "READ_BATCH_BYTES", 4096)
    original = saved_state(directory / "torch")
    assert convert(["--load", str(directory / "torch"), "--save", str(directory / "dist"),
                    "--ckpt-format", "torch_dist"]) == 0  # fmt: skip
    assert (directory / "dist" / "iter_0000005" / "metadata.json").is_file()
    assert convert(["--load", str(directory / "dist"), "--save", str(directory / "back"),
                    "--ckpt-format", "torch"]) == 0  # fmt: skip
    assert "converted to torch:" in capsys.readouterr().out
    back = torch.load(
        directory / "back" / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt",
        weights_only=False,
    )
    assert_identical(original, back)
    assert_identical(original, saved_state(directory / "dist"))


def test_the_converted_checkpoint_resumes_the_run(torch_run, tmp_path):
    """Iteration 3, converted to torch_dist, continues to the original run's losses exactly."""
    directory, args, result = torch_run
    shutil.copytree(directory / "torch", tmp_path / "torch")
    (tmp_path / "torch" / "latest_checkpointed_iteration.txt").write_text("3")
    convert(["--load", str(tmp_path / "torch"), "--save", str(tmp_path / "dist"),
             "--ckpt-format", "torch_dist"])  # fmt: skip
    resumed = pretrain_gpt.main(
        [*args, "--load", str(tmp_path / "dist"), "--save", str(tmp_path / "next")]
    )
    assert resumed.iteration == 5
    assert resumed.losses == result.losses[3:]


def test_refusals_are_one_line(torch_run, capsys):
    directory, _, _ = torch_run
    code = convert(["--load", str(directory / "torch"), "--save", str(directory / "same"),
                    "--ckpt-format", "torch"])  # fmt: skip
    assert code == 1
    assert "is already in the torch format; nothing to convert" in capsys.readouterr().err
