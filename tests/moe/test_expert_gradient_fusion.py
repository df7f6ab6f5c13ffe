"""The fused accumulation of expert weight gradients (moe.experts.refresh_compute_weights) in
bf16 under torchrun (gloo, CPU), in the layouts where the trainer uses it: expert parallelism
(experts outside torch DDP) and the distributed optimizer (gradients bound to its buffer).

Each run matches the same run with --no-gradient-accumulation-fusion (autocast's casts, autograd's
accumulation) exactly: the copies round as the casts do, and the fused adds are autograd's adds
in its order. A lost or doubled micro-batch gradient would change
the grad norm of the first iteration already.
"""

from __future__ import annotations

import pytest

from tests.moe.test_expert_parallel_gpt import moe_gpt_args, run


@pytest.mark.parametrize(
    "world_size, layout",
    [
        (2, ["--expert-model-parallel-size", "2"]),
        (2, ["--use-distributed-optimizer"]),
        # The pipeline's data-parallel all-reduce reads the expert gradients right after the
        # schedule: the held micro-batch gradients must be added before it.
        (4, ["--pipeline-model-parallel-size", "2"]),
        # The copies refreshed layer by layer, each once its weights have arrived.
        (
            2,
            [
                "--use-distributed-optimizer",
                "--overlap-grad-reduce",
                "--overlap-param-gather",
                "--ddp-bucket-size",
                "20000",
            ],
        ),  # fmt: skip
    ],
    ids=[
        "expert-parallel",
        "distributed-optimizer",
        "pipeline-data-parallel",
        "distributed-optimizer-overlapped",
    ],
)
def test_fused_expert_gradient_accumulation_equals_autograds(
    data_prefix, tmp_path, world_size, layout
):
    # Three micro-batches per rank: one gradient is still held after the last backward.
    args = moe_gpt_args(
        data_prefix, "--bf16", "--global-batch-size", "12", *layout, "--train-iters", "3"
    )
    fused = run(world_size, args, tmp_path / "fused")
    unfused = run(world_size, args + ["--no-gradient-accumulation-fusion"], tmp_path / "unfused")
    for name in ("lm loss", "load balancing loss", "grad-norm"):
        assert len(fused[name]) == 3
        assert fused[name] == unfused[name], name
