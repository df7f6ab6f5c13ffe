"""pretrain_gpt.py under torchrun on 2-4 GPUs over NCCL: every parallel layout of a tiny dMoE GPT
gives the one-GPU run's losses, load-balancing losses and grad norms, and a torch_dist
checkpoint saved at one layout resumes at another; a dense GPT, which torch.compile captures
whole on GPUs, gives them at TP2 and TP2 with sequence parallelism; so does the bf16 dMoE, compiled
whole on Hopper, at EP2 and TP2 (within bf16's differences of sum order).

GPU-marked (`pytest -m gpu tests/parallel/test_gpu_layouts.py` on a machine with 2 or 4
GPUs); each test skips cleanly where the machine has fewer GPUs than its layout needs. The runs
are fp32 with --deterministic-mode, so that one layout repeats itself bit for bit and layouts
differ only by the order of their sums (within RELATIVE). Global batch 8 in micro-batches of 2,
as in test_expert_parallel_gpt: every micro-batch holds the same samples at any data-parallel
size, so the load-balancing loss is the same number too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.launch import pretrain_on_gpus
from tests.tiny_gpt import MOE_ARGS, tiny_gpt_args

ITERATIONS = 6
SCALARS = ("lm loss", "load balancing loss", "grad-norm")
RELATIVE = 1e-4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs 2 or more GPUs",
    ),
]


def gpus(count: int):
    """Skip unless the machine has `count` GPUs."""
    return pytest.mark.skipif(torch.cuda.device_count() < count, reason=f"needs {count} GPUs")


def dmoe_args(data_prefix: str, *extra: str) -> list:
    return tiny_gpt_args(
        data_prefix, *MOE_ARGS, "--deterministic-mode", "--ckpt-format", "torch_dist",
        # The vocabulary padded to 50304 at TP = 1 and 2 alike (a multiple of 64 x TP).
        "--make-vocab-size-divisible-by", "64", *extra,
        seq_length=32, micro_batch=2, global_batch=8, train_iters=ITERATIONS, eval_iters=0,
    )  # fmt: skip


def torchrun(nproc: int, args: list, tensorboard: Path) -> dict:
    """pretrain_gpt.py on `nproc` GPUs under torchrun (NCCL); stdout and the scalars."""
    return pretrain_on_gpus(nproc, args, tensorboard, SCALARS)


def assert_same(expected: dict, actual: dict, iterations, tolerances=None) -> None:
    """Every scalar of `tolerances` ({name: relative tolerance}; default: SCALARS within
    RELATIVE) at every step of `iterations`."""
    for name, relative in (tolerances or dict.fromkeys(SCALARS, RELATIVE)).items():
        for step in iterations:
            assert actual[name][step] == pytest.approx(expected[name][step], rel=relative), (
                name, step, expected[name], actual[name],
            )  # fmt: skip


@pytest.fixture(scope="module")
def one_gpu(data_prefix, tmp_path_factory):
    root = tmp_path_factory.mktemp("one_gpu")
    return torchrun(1, dmoe_args(data_prefix), root / "tb")


LAYOUTS = {
    "ep2": (2, ["--expert-model-parallel-size", "2"]),
    "ep2_fixed_size_blocks": (
        2,
        ["--expert-model-parallel-size", "2", "--moe-expert-parallel-buffer-factor", "1.5"],
    ),
    "dp2_distributed_optimizer": (2, ["--use-distributed-optimizer"]),
    # Compiled layer by layer, gradients reduce-scattered in buckets of 100,000 parameters
    # during the backward, parameters all-gathered during the next forward.
    "dp2_distributed_optimizer_overlapped": (
        2,
        [
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
            "--overlap-param-gather",
            "--ddp-bucket-size",
            "100000",
        ],
    ),  # fmt: skip
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "tp2_ep2_sequence_parallel": (
        4,
        [
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--expert-model-parallel-size",
            "2",
        ],
    ),  # fmt: skip
    "ep2_dp2_distributed_optimizer": (
        4,
        [
            "--expert-model-parallel-size",
            "2",
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
        ],
    ),
    # torch's fully_shard over NCCL (megatron.parallelize.fully_shard).
    "dp2_fsdp2": (2, ["--use-torch-fsdp2"]),
    "ep2_dp2_fsdp2": (4, ["--use-torch-fsdp2", "--expert-model-parallel-size", "2"]),
    "tp2_dp2_fsdp2": (4, ["--use-torch-fsdp2", "--tensor-model-parallel-size", "2"]),
    "hybrid_2x2_fsdp2": (4, ["--use-torch-fsdp2", "--data-parallel-replicate-degree", "2"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_one_gpu(layout, one_gpu, data_prefix, tmp_path):
    nproc, flags = LAYOUTS[layout]
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    run = torchrun(nproc, dmoe_args(data_prefix, *flags), tmp_path / "tb")
    assert_same(one_gpu, run, range(1, ITERATIONS + 1))


@gpus(2)
def test_torch_dist_checkpoint_resumes_at_another_layout(one_gpu, data_prefix, tmp_path):
    """Saved at EP2 (with the distributed optimizer) at iteration 3, resumed at PP2 and on one
    GPU: iterations 4-6 are the one-GPU run's."""
    save = tmp_path / "ckpt"
    torchrun(
        2,
        dmoe_args(
            data_prefix, "--expert-model-parallel-size", "2", "--use-distributed-optimizer",
            "--save", str(save), "--save-interval", "3", "--exit-interval", "3",
        ),
        tmp_path / "tb_saved",
    )  # fmt: skip
    for nproc, flags, name in (
        (2, ["--pipeline-model-parallel-size", "2"], "pp2"),
        (1, [], "one_gpu"),
    ):
        resumed = torchrun(
            nproc,
            dmoe_args(data_prefix, *flags, "--load", str(save), "--no-load-rng"),
            tmp_path / f"tb_{name}",
        )
        assert "loaded checkpoint" in resumed["stdout"] and "at iteration 3" in resumed["stdout"]
        assert sorted(resumed["lm loss"]) == [4, 5, 6], resumed["lm loss"]
        assert_same(one_gpu, resumed, range(4, ITERATIONS + 1))


DENSE_SCALARS = ("lm loss", "grad-norm")
# The run's report after its first iteration (megatron.training.logging.format_compile_report).
COMPILE_REPORT = re.compile(r"> torch\.compile \(after \d+ iterations\): (\d+) graphs, (\d+) graph")


def compiled(run: dict) -> dict:
    """`run`, after checking that it compiled its model whole: the whole-model compile line,
    and dynamo's graphs without a break (on one H200 both the dense GPT and the bf16 dMoE are
    one graph). A run left eager, as --no-torch-compile or a hook's veto leaves it, would
    compare eager layouts."""
    output = run["stdout"]
    assert "> torch.compile: the whole model" in output, output[-3000:]
    report = COMPILE_REPORT.search(output)
    assert report is not None and int(report.group(1)) > 0, output[-3000:]
    assert int(report.group(2)) == 0, report.group(0)
    return run


@pytest.fixture(scope="module")
def one_gpu_dense(data_prefix, tmp_path_factory):
    root = tmp_path_factory.mktemp("one_gpu_dense")
    return compiled(pretrain_on_gpus(1, dense_args(data_prefix), root / "tb", DENSE_SCALARS))


def dense_args(data_prefix: str, *extra: str) -> list:
    """The dense GPT, compiled (pretrain_gpt.py's default on GPUs), fp32, deterministic."""
    return tiny_gpt_args(
        data_prefix, "--deterministic-mode", "--make-vocab-size-divisible-by", "64", *extra,
        train_iters=ITERATIONS, eval_iters=0,
    )  # fmt: skip


@gpus(2)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sp"])
def test_compiled_tensor_parallel_equals_one_gpu(
    sequence_parallel, one_gpu_dense, data_prefix, tmp_path
):
    """The compiled backward all-reduces, gathers and reduce-scatters the tensor-parallel
    gradients before it reads them (megatron/parallel/collectives.py: with in-place
    collectives its column-parallel input gradients stayed partial, grad norm 1.03 for 1.36)."""
    layout = ["--tensor-model-parallel-size", "2"] + (["--sequence-parallel"] * sequence_parallel)
    run = pretrain_on_gpus(2, dense_args(data_prefix, *layout), tmp_path / "tb", DENSE_SCALARS)
    compiled(run)
    assert_same(
        one_gpu_dense, run, range(1, ITERATIONS + 1), dict.fromkeys(DENSE_SCALARS, RELATIVE)
    )


# bf16 sums in another order: the dense GPT's TP2 loss is within 1e-5 of one GPU's and its grad
# norm within 7e-4; partial gradients moved the loss 0.3% by step 3 and the grad norm 24%.
BF16_RELATIVE = {"lm loss": 1e-3, "grad-norm": 1e-2}
BF16_ITERATIONS = 5


@pytest.fixture(scope="module")
def one_gpu_bf16_dmoe(data_prefix, tmp_path_factory):
    root = tmp_path_factory.mktemp("one_gpu_bf16_dmoe")
    return compiled(pretrain_on_gpus(1, bf16_dmoe_args(data_prefix), root / "tb", DENSE_SCALARS))


def bf16_dmoe_args(data_prefix: str, *extra: str) -> list:
    """The dMoE in bf16, where Hopper's torch._grouped_mm runs its experts and torch.compile
    captures the whole model (moe.training_hooks), collectives included."""
    return tiny_gpt_args(
        data_prefix, *MOE_ARGS, "--bf16", "--make-vocab-size-divisible-by", "64", *extra,
        train_iters=BF16_ITERATIONS, eval_iters=0,
    )  # fmt: skip


@gpus(2)
@pytest.mark.parametrize(
    "layout",
    [["--expert-model-parallel-size", "2"], ["--tensor-model-parallel-size", "2"]],
    ids=["ep2", "tp2"],
)
def test_compiled_bf16_dmoe_layout_follows_one_gpu(
    layout, one_gpu_bf16_dmoe, data_prefix, tmp_path
):
    run = pretrain_on_gpus(2, bf16_dmoe_args(data_prefix, *layout), tmp_path / "tb", DENSE_SCALARS)
    compiled(run)
    assert_same(one_gpu_bf16_dmoe, run, range(1, BF16_ITERATIONS + 1), BF16_RELATIVE)
