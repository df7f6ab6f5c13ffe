"""--use-precision-aware-optimizer (bf16 main gradients and Adam moments) in pretrain_gpt.py on gloo
ranks as torchrun starts them (CPU, a dMoE GPT under bf16 autocast), at every kind of layout: data parallel
without DDP (the main gradients are all-reduced after the last backward), the distributed
optimizer, tensor, pipeline and expert parallelism. Each gives the single process's losses and
grad norms to within what bf16 gradients summed in another order allow; checkpoints hold the
moments in bf16, resume exactly at the same layout, and load into a run with fp32 state with
the conversion stated on the load line."""

from __future__ import annotations

import re

import pytest
import torch

import pretrain_gpt
from tests.launch import pretrain_ranks
from tests.tiny_gpt import MOE_ARGS, saved_state, tiny_gpt_args

ITERATIONS = 5
SCALARS = ("lm loss", "grad-norm")
BF16_STATE = (
    "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16",
    "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16",
)  # fmt: skip
# Relative. bf16 gradients summed over micro-batches and ranks in another order differ by about
# 2**-8 of a gradient; over 5 steps the losses stay within 1e-3 of each other, the grad norms
# (which see the gradients directly) within 1e-2.
LOSS_TOLERANCE = 1e-3
NORM_TOLERANCE = 1e-2
LAYOUTS = {
    "dp2": [],
    "dp2-distributed-optimizer": ["--use-distributed-optimizer"],
    # bf16 main gradients added by autograd's hooks and by the expert copies, then reduced in
    # buckets during the backward; parameters gathered during the next forward.
    "dp2-distributed-optimizer-overlapped": [
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        "--ddp-bucket-size", "20000",
    ],
    "tp2": ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "ep2-distributed-optimizer": [
        "--expert-model-parallel-size", "2", "--use-distributed-optimizer",
    ],
}  # fmt: skip


def args(data_prefix, *extra):
    """The dMoE GPT in bf16 with bf16 optimizer state: micro-batches of 2 in a global batch of
    8, 32-token samples, no evaluation."""
    return tiny_gpt_args(
        data_prefix, *MOE_ARGS, "--bf16", *BF16_STATE, *extra,
        seq_length=32, micro_batch=2, global_batch=8, train_iters=ITERATIONS, eval_iters=0,
    )  # fmt: skip


@pytest.fixture(scope="module")
def single(data_prefix, tmp_path_factory):
    return pretrain_ranks(
        1, args(data_prefix), tmp_path_factory.mktemp("single") / "tb", scalars=SCALARS
    )


def _assert_close(expected, actual):
    for name, tolerance in zip(SCALARS, (LOSS_TOLERANCE, NORM_TOLERANCE)):
        assert sorted(actual[name]) == list(range(1, ITERATIONS + 1)), actual[name]
        for step in range(1, ITERATIONS + 1):
            assert actual[name][step] == pytest.approx(expected[name][step], rel=tolerance), (
                name,
                expected[name],
                actual[name],
            )


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_matches_single_process(single, data_prefix, tmp_path, layout):
    run = pretrain_ranks(2, args(data_prefix, *LAYOUTS[layout]), tmp_path / "tb", scalars=SCALARS)
    assert "precision-aware optimizer: main gradients bf16" in run["stdout"]
    _assert_close(single, run)


def _losses(result):
    return [entry["lm loss"] for entry in result.losses]


def test_checkpoint_keeps_bf16_moments_resumes_exactly_and_loads_into_fp32_state(
    data_prefix, tmp_path, capsys
):
    """5 iterations straight == 3, save, resume for 2 more (bf16 moments in the checkpoint);
    the same checkpoint resumed without the precision-aware optimizer (torch's AdamW, fp32
    moments) says on its load line that it converted them, and trains on from there."""
    straight = pretrain_gpt.main(args(data_prefix))
    checkpoints = str(tmp_path / "ckpt")
    saving = ["--save", checkpoints, "--save-interval", "3"]
    first = pretrain_gpt.main(args(data_prefix, *saving, "--exit-interval", "3"))
    state = saved_state(tmp_path / "ckpt", 3)
    moments = [
        value
        for entry in state["optimizer"]["optimizer"]["state"].values()
        for key, value in entry.items()
        if key in ("exp_avg", "exp_avg_sq")
    ]
    assert moments and all(value.dtype == torch.bfloat16 for value in moments)

    capsys.readouterr()
    fp32_state = tiny_gpt_args(
        data_prefix, *MOE_ARGS, "--bf16", "--load", checkpoints,
        seq_length=32, micro_batch=2, global_batch=8, train_iters=ITERATIONS, eval_iters=0,
    )  # fmt: skip
    converted = pretrain_gpt.main(fp32_state)
    output = capsys.readouterr().out
    line = next(line for line in output.splitlines() if line.startswith("loaded checkpoint"))
    assert re.search(
        r"at iteration 3 \(optimizer state converted: exp_avg bf16 -> fp32, "
        r"exp_avg_sq bf16 -> fp32\)$",
        line,
    ), line
    assert _losses(converted)[0] == pytest.approx(_losses(straight)[3], rel=LOSS_TOLERANCE)

    second = pretrain_gpt.main(args(data_prefix, *saving, "--load", checkpoints))
    assert _losses(first) + _losses(second) == _losses(straight)


def test_distributed_optimizer_checkpoint_resumes_in_one_process(single, data_prefix, tmp_path):
    """The distributed optimizer's bf16 moments, gathered from 2 ranks into a torch_dist
    checkpoint at iteration 3, load into one process, which continues the 2-rank run as one
    process would have."""
    checkpoints = tmp_path / "ckpt"
    saving = ["--save", str(checkpoints), "--save-interval", "3", "--exit-interval", "3"]
    pretrain_ranks(2, args(data_prefix, "--use-distributed-optimizer", *saving), tmp_path / "tb")
    state = saved_state(checkpoints, 3)
    dtypes = {
        value.dtype
        for entry in state["optimizer"]["optimizer"]["state"].values()
        for key, value in entry.items()
        if key in ("exp_avg", "exp_avg_sq")
    }
    assert dtypes == {torch.bfloat16}
    resumed = pretrain_gpt.main(args(data_prefix, "--load", str(checkpoints)))
    for step, loss in zip((4, 5), _losses(resumed)):
        assert loss == pytest.approx(single["lm loss"][step], rel=LOSS_TOLERANCE)
