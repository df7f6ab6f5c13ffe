"""The run's numerics (megatron.config.numerics), decided once from the flags: what each
combination of precision flags gives every reader."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gpt_pretraining.generation import generation_dtype
from megatron.config.numerics import Numerics
from tests.config.command_lines import config

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
PRECISION_AWARE = ("--use-precision-aware-optimizer",)


@pytest.mark.parametrize(
    "flags, expected",
    [
        ((), Numerics(FP32, None, FP32, FP32, None, 0.0)),
        (("--bf16",), Numerics(BF16, None, FP32, FP32, BF16, 0.0)),
        (("--fp16",), Numerics(FP16, None, FP32, FP32, FP16, 0.0)),
        (("--bf16", "--no-gradient-accumulation-fusion"), Numerics(BF16, None, FP32, FP32, None, 0.0)),
        (
            ("--bf16", *PRECISION_AWARE, "--main-grads-dtype", "bf16", "--exp-avg-dtype", "bf16"),
            Numerics(BF16, BF16, BF16, FP32, BF16, 0.0),
        ),
        # fp32 main gradients are the parameters' own .grad.
        (("--bf16", *PRECISION_AWARE, "--main-grads-dtype", "fp32"), Numerics(BF16, None, FP32, FP32, BF16, 0.0)),
        (
            ("--bf16", "--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"),
            Numerics(BF16, None, FP32, FP32, BF16, 0.5),
        ),
        (
            ("--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "rowwise"),
            Numerics(BF16, None, FP32, FP32, BF16, 0.0, "hybrid", "rowwise"),
        ),
        # The recipe means nothing without a format.
        (("--bf16", "--fp8-recipe", "rowwise"), Numerics(BF16, None, FP32, FP32, BF16, 0.0)),
    ],
)  # fmt: skip
def test_precision_flags_decide_the_numerics(flags, expected):
    numerics = config(*flags).numerics
    assert numerics == expected
    assert numerics.autocast == (expected.compute_dtype != FP32)
    assert numerics.loss_scaling == (expected.compute_dtype == FP16)
    assert numerics.compute_bytes == expected.compute_dtype.itemsize


def test_a_changed_config_gets_its_own_numerics():
    """The memory planner tries changed sections (megatron.memory_plan.suggestions): the
    numerics follow them, never a stale copy."""
    cfg = config("--bf16")
    optimizer = dataclasses.replace(
        cfg.optimizer, use_precision_aware_optimizer=True, main_grads_dtype="bf16"
    )
    assert dataclasses.replace(cfg, optimizer=optimizer).numerics.main_grads_dtype == BF16
    assert cfg.numerics.main_grads_dtype is None


@pytest.mark.parametrize(
    "flags, device, expected",
    [
        (("--bf16",), "cuda", BF16),
        (("--fp16",), "cuda", FP16),
        ((), "cuda", FP32),
        (("--bf16",), "cpu", FP32),
    ],
)
def test_generation_runs_in_the_dtype_the_run_trained_in(flags, device, expected):
    """Generation's --dtype auto reads the checkpoint's numerics on a GPU (fp32 on the CPU);
    a --dtype given wins."""
    trained = config(*flags)
    assert generation_dtype(trained, torch.device(device), None) == expected
    assert generation_dtype(trained, torch.device(device), FP16) == FP16
