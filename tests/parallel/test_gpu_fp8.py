"""pretrain_gpt.py with --fp8-format on GPUs with FP8 tensor cores (NVIDIA compute capability
8.9+, AMD MI300): the FP8 run follows the bf16 run's losses (a dMoE's too, its experts in FP8 on
Hopper), tensor parallelism gives one GPU's FP8 losses, and checkpoints move between FP8 and
bf16 runs either way.

GPU-marked (`pytest -m gpu tests/parallel/test_gpu_fp8.py`); the tests skip cleanly on a machine
without FP8 units or with fewer GPUs than they need. A tiny GPT (hidden 64: every projection's
dimensions are multiples of 16, as torch._scaled_mm requires), bf16, 20 iterations; each
distinct run is made once per module and shared by the tests that compare against it.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Tuple

import pytest
import torch

from megatron.kernels.fp8_linear import fp8_unsupported
from moe.kernels.grouped_gemm import torch_grouped_mm_is_fast_on
from tests.launch import pretrain_on_gpus
from tests.tiny_gpt import tiny_gpt_args

ITERATIONS = 20
# Every run saves here too, so a later run can resume from any of them (the checkpoint test).
SAVED_AT = 10
HYBRID = {recipe: ("--fp8-format", "hybrid", "--fp8-recipe", recipe)
          for recipe in ("tensorwise", "rowwise")}  # fmt: skip
DMOE = ("--moe-num-experts", "4", "--moe-top-k", "2")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or fp8_unsupported(torch.device("cuda")) is not None,
        reason="needs a GPU with FP8 tensor cores",
    ),
]


@dataclass(frozen=True)
class Run:
    losses: Dict[int, float]  # {iteration: lm loss}
    stdout: str
    checkpoints: Path  # saved at SAVED_AT and at the end


def run(nproc: int, data_prefix: str, root: Path, *extra: str) -> Run:
    """One pretraining run on `nproc` GPUs (tests.launch.pretrain_on_gpus: one GPU in this
    process, several under torchrun)."""
    save = ("--save", str(root / "ckpt"), "--save-interval", str(SAVED_AT))
    args = tiny_gpt_args(
        data_prefix, "--bf16", "--make-vocab-size-divisible-by", "64", *save, *extra,
        train_iters=ITERATIONS, eval_iters=0,
    )  # fmt: skip
    result = pretrain_on_gpus(nproc, args, root / "tb", ["lm loss"])
    return Run(result["lm loss"], result["stdout"], root / "ckpt")


@pytest.fixture(scope="module")
def runs(data_prefix, tmp_path_factory) -> Callable[..., Run]:
    """`runs(nproc, *flags)`: that run, made once per module; the tests share the bf16 and FP8
    runs they compare against (each run compiles a model of its own)."""
    done: Dict[Tuple, Run] = {}

    def get(nproc: int, *extra: str) -> Run:
        key = (nproc, *extra)
        if key not in done:
            done[key] = run(nproc, data_prefix, tmp_path_factory.mktemp("run"), *extra)
        return done[key]

    return get


def assert_close(expected: dict, actual: dict, relative: float) -> None:
    assert actual.keys() == expected.keys()
    for step, loss in expected.items():
        assert actual[step] == pytest.approx(loss, rel=relative), (step, expected, actual)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_follows_the_bf16_losses(recipe, runs):
    bf16, fp8 = runs(1).losses, runs(1, *HYBRID[recipe]).losses
    assert fp8 != bf16  # the products were quantized
    assert_close(bf16, fp8, relative=0.02)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("recipe", ["rowwise", None], ids=["fp8", "bf16"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sp"])
def test_fp8_under_tensor_parallelism_follows_one_gpu(sequence_parallel, recipe, runs):
    """The ranks quantize with one process's scales (megatron.kernels.fp8_linear.amax_groups):
    the layout changes only the order of sums, so FP8 follows one GPU as closely as bf16 does
    (the bf16 case is the yardstick)."""
    fp8 = HYBRID[recipe] if recipe else ()
    layout = ["--tensor-model-parallel-size", "2"]
    if sequence_parallel:
        layout.append("--sequence-parallel")
    assert_close(runs(1, *fp8).losses, runs(2, *fp8, *layout).losses, relative=0.01)


@pytest.mark.parametrize("first, then", [("fp8", "bf16"), ("bf16", "fp8")])
def test_a_checkpoint_moves_between_fp8_and_bf16(first, then, runs, data_prefix, tmp_path):
    """Saved at iteration 10 by one kind of run, resumed to 20 by the other: the same parameter
    names and dtypes, so the load takes them all, and the losses go on from there."""
    flags = {"fp8": HYBRID["tensorwise"], "bf16": ()}
    saved = tmp_path / "saved"
    name = f"iter_{SAVED_AT:07d}"
    shutil.copytree(runs(1, *flags[first]).checkpoints / name, saved / name)
    (saved / "latest_checkpointed_iteration.txt").write_text(str(SAVED_AT))
    resumed = run(1, data_prefix, tmp_path / "then", *flags[then], "--load", str(saved)).losses
    assert min(resumed) == SAVED_AT + 1
    straight = runs(1, *flags[then]).losses
    later = {step: loss for step, loss in straight.items() if step > SAVED_AT}
    assert_close(later, resumed, relative=0.05)


@pytest.mark.skipif(
    not torch.cuda.is_available() or not torch_grouped_mm_is_fast_on(torch.device("cuda")),
    reason="FP8 experts need Hopper",
)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_dmoe_with_fp8_experts_follows_the_bf16_losses(recipe, runs):
    """The dMoE's grouped expert GEMMs in FP8 (torch._scaled_grouped_mm, compiled with the
    rest): the run says nothing stays in bf16, and its losses follow the bf16 run's."""
    bf16, fp8 = runs(1, *DMOE), runs(1, *DMOE, *HYBRID[recipe])
    assert "stays in bf16" not in fp8.stdout
    assert fp8.losses != bf16.losses
    assert_close(bf16.losses, fp8.losses, relative=0.02)
