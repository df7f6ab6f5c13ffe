"""Who reduces the data-parallel gradients (megatron.parallel.gradient_sync.gradient_reduction), decided
once from the config: what parallelize wraps in DDP, what the trainer reduces after the last
backward and what the memory planner counts all follow it. (The reductions themselves are
tested end to end against one process in the tests of each layout.)"""

from __future__ import annotations

import pytest

from megatron.parallel.gradient_sync import (
    AFTER_BACKWARD,
    DDP,
    NO_REDUCTION,
    OPTIMIZER,
    GradientSync,
    gradient_reduction,
)
from tests.config.command_lines import config

MAIN_GRADS = ("--bf16", "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16")


@pytest.mark.parametrize(
    "flags, world_size, reduction",
    [
        ((), 1, NO_REDUCTION),
        ((), 2, DDP),
        (("--use-distributed-optimizer",), 2, OPTIMIZER),
        (("--use-distributed-optimizer",), 1, OPTIMIZER),
        (("--pipeline-model-parallel-size", "2"), 4, AFTER_BACKWARD),
        (("--pipeline-model-parallel-size", "2"), 2, NO_REDUCTION),
        (MAIN_GRADS, 2, AFTER_BACKWARD),
        (("--tensor-model-parallel-size", "2"), 2, NO_REDUCTION),
        (("--tensor-model-parallel-size", "2"), 4, DDP),
    ],
)
def test_one_decision_for_every_layout(flags, world_size, reduction):
    cfg = config(*flags, world_size=world_size)
    assert gradient_reduction(cfg) == reduction
    sync = GradientSync.of(cfg)
    assert sync.reduction == reduction and sync.in_ddp == (reduction == DDP)
    assert sync.pipeline == (cfg.parallel.pipeline_model_parallel_size > 1)
