"""--use-torch-fsdp2 on one GPU (a mesh of one rank: every gather and reduce-scatter runs, over
NCCL), against the same run without it: the compiled fp32 dense GPT within fp32's sum order,
and the compiled bf16 dMoE on the grouped GEMM (torch._grouped_mm on Hopper) with the fused
kernels within bf16's. Each layer's forward compiles on its own under FSDP2, its gathers
eager around it. GPU-marked; the multi-GPU layouts are in tests/parallel/test_gpu_layouts.py."""

from __future__ import annotations

import pytest

from tests.launch import pretrain_on_gpus
from tests.markers import gpu
from tests.tiny_gpt import MOE_ARGS, tiny_gpt_args

ITERATIONS = 6
SCALARS = ("lm loss", "grad-norm")
BY_LAYER = "> torch.compile: each transformer layer's forward"


def run_pair(data_prefix, tmp_path, *flags: str):
    args = tiny_gpt_args(
        data_prefix, "--make-vocab-size-divisible-by", "64", *flags,
        train_iters=ITERATIONS, eval_iters=0,
    )  # fmt: skip
    plain = pretrain_on_gpus(1, args, tmp_path / "plain", SCALARS)
    sharded = pretrain_on_gpus(1, [*args, "--use-torch-fsdp2"], tmp_path / "fsdp2", SCALARS)
    assert BY_LAYER in sharded["stdout"], sharded["stdout"][-3000:]
    return plain, sharded


def assert_close(plain, sharded, tolerances):
    for name, relative in tolerances.items():
        for step in range(1, ITERATIONS + 1):
            assert sharded[name][step] == pytest.approx(plain[name][step], rel=relative), (
                name, step, plain[name], sharded[name],
            )  # fmt: skip


@gpu
def test_compiled_dense_gpt_under_fsdp2_equals_the_run_without(data_prefix, tmp_path):
    plain, sharded = run_pair(data_prefix, tmp_path, "--deterministic-mode")
    assert_close(plain, sharded, {"lm loss": 1e-5, "grad-norm": 1e-4})


@gpu
def test_compiled_bf16_dmoe_under_fsdp2_follows_the_run_without(data_prefix, tmp_path):
    """bf16: the norms' weights and the biases are gathered in bf16 with their layer (the
    residual stream stays fp32), a rounding the run without FSDP2 does not make."""
    plain, sharded = run_pair(data_prefix, tmp_path, *MOE_ARGS, "--bf16")
    assert_close(plain, sharded, {"lm loss": 1e-3, "grad-norm": 2e-2})
