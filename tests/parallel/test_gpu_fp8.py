"""pretrain_gpt.py with --fp8-format on GPUs with FP8 tensor cores (NVIDIA compute capability
8.9+, AMD MI300): the FP8 run follows the bf16 run's losses (a dMoE's too, its experts in FP8 on
Hopper), tensor parallelism gives one GPU's FP8 losses, and checkpoints move between FP8 and
bf16 runs either way.

GPU-marked (`pytest -m gpu tests/parallel/test_gpu_fp8.py`); the tests skip cleanly on a machine
without FP8 units or with fewer GPUs than they need. A tiny GPT (hidden 64: every projection's
dimensions are multiples of 16, as torch._scaled_mm requires), bf16, 20 iterations.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron.kernels.fp8_linear import fp8_unsupported
from moe.kernels.grouped_gemm import torch_grouped_mm_is_fast_on
from tests.launch import pretrain_on_gpus
from tests.tiny_gpt import tiny_gpt_args

ITERATIONS = 20

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or fp8_unsupported(torch.device("cuda")) is not None,
        reason="needs a GPU with FP8 tensor cores",
    ),
]


def run(nproc: int, data_prefix: str, root: Path, *extra: str, stdout: bool = False):
    """The run's {iteration: lm loss}, on `nproc` GPUs under torchrun (NCCL); with `stdout`,
    also what it printed."""
    args = tiny_gpt_args(
        data_prefix, "--bf16", "--make-vocab-size-divisible-by", "64", *extra,
        train_iters=ITERATIONS, eval_iters=0,
    )  # fmt: skip
    result = pretrain_on_gpus(nproc, args, root / "tb", ["lm loss"])
    return (result["lm loss"], result["stdout"]) if stdout else result["lm loss"]


def assert_close(expected: dict, actual: dict, relative: float) -> None:
    assert actual.keys() == expected.keys()
    for step, loss in expected.items():
        assert actual[step] == pytest.approx(loss, rel=relative), (step, expected, actual)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_follows_the_bf16_losses(recipe, data_prefix, tmp_path):
    bf16 = run(1, data_prefix, tmp_path / "bf16")
    fp8 = run(1, data_prefix, tmp_path / "fp8", "--fp8-format", "hybrid", "--fp8-recipe", recipe)
    assert fp8 != bf16  # the products were quantized
    assert_close(bf16, fp8, relative=0.02)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("recipe", ["rowwise", None], ids=["fp8", "bf16"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sp"])
def test_fp8_under_tensor_parallelism_follows_one_gpu(
    sequence_parallel, recipe, data_prefix, tmp_path
):
    """The ranks quantize with one process's scales (megatron.kernels.fp8_linear.amax_groups):
    the layout changes only the order of sums, so FP8 follows one GPU as closely as bf16 does
    (the bf16 case is the yardstick)."""
    fp8 = ("--fp8-format", "hybrid", "--fp8-recipe", recipe) if recipe else ()
    one_gpu = run(1, data_prefix, tmp_path / "one", *fp8)
    layout = ["--tensor-model-parallel-size", "2"]
    if sequence_parallel:
        layout.append("--sequence-parallel")
    assert_close(one_gpu, run(2, data_prefix, tmp_path / "tp2", *fp8, *layout), relative=0.01)


@pytest.mark.parametrize("first, then", [("fp8", "bf16"), ("bf16", "fp8")])
def test_a_checkpoint_moves_between_fp8_and_bf16(first, then, data_prefix, tmp_path):
    """Saved at iteration 10 by one kind of run, resumed to 20 by the other: the same parameter
    names and dtypes, so the load takes them all, and the losses go on from there."""
    flags = {"fp8": ("--fp8-format", "e4m3"), "bf16": ()}
    save = ("--save", str(tmp_path / "ckpt"), "--save-interval", "10")
    straight = run(1, data_prefix, tmp_path / "straight", *flags[then])
    run(1, data_prefix, tmp_path / "first", *flags[first], *save, "--exit-interval", "10")
    resumed = run(1, data_prefix, tmp_path / "then", *flags[then], *save, "--load", save[1])
    assert min(resumed) == 11
    later = {step: loss for step, loss in straight.items() if step > 10}
    assert_close(later, resumed, relative=0.05)


@pytest.mark.skipif(
    not torch.cuda.is_available() or not torch_grouped_mm_is_fast_on(torch.device("cuda")),
    reason="FP8 experts need Hopper",
)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_dmoe_with_fp8_experts_follows_the_bf16_losses(recipe, data_prefix, tmp_path):
    """The dMoE's grouped expert GEMMs in FP8 (torch._scaled_grouped_mm, compiled with the
    rest): the run says nothing stays in bf16, and its losses follow the bf16 run's."""
    moe = ("--moe-num-experts", "4", "--moe-top-k", "2")
    bf16 = run(1, data_prefix, tmp_path / "bf16", *moe)
    fp8, printed = run(
        1, data_prefix, tmp_path / "fp8", *moe, "--fp8-format", "hybrid", "--fp8-recipe", recipe,
        stdout=True,
    )  # fmt: skip
    assert "stays in bf16" not in printed
    assert fp8 != bf16
    assert_close(bf16, fp8, relative=0.02)
