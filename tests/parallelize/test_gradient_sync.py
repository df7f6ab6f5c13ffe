"""Who reduces the data-parallel gradients, decided once from the config by the data-parallel
mode (megatron.parallelize.data_parallel_mode chooses the mode; a replicated model's reduction
is megatron.parallelize.gradient_sync.replicated_reduction): what parallelize wraps in DDP,
what the trainer reduces after the last backward and what the memory planner counts all follow
it. (The reductions themselves are tested end to end against one process in the tests of each
layout.)"""

from __future__ import annotations

import pytest

from megatron.config.numerics import Numerics
from megatron.parallelize.data_parallel import (
    Replicated,
    ShardedOptimizerState,
)
from megatron.parallelize.data_parallel_mode import data_parallel_mode
from megatron.parallelize.fully_shard import FullyShard
from megatron.parallelize.gradient_sync import (
    AFTER_BACKWARD,
    DDP,
    FULLY_SHARD,
    NO_REDUCTION,
    OPTIMIZER,
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
        (("--use-torch-fsdp2",), 2, FULLY_SHARD),
        (("--use-torch-fsdp2",), 1, FULLY_SHARD),
        (("--pipeline-model-parallel-size", "2"), 4, AFTER_BACKWARD),
        (("--pipeline-model-parallel-size", "2"), 2, NO_REDUCTION),
        (MAIN_GRADS, 2, AFTER_BACKWARD),
        (("--tensor-model-parallel-size", "2"), 2, NO_REDUCTION),
        (("--tensor-model-parallel-size", "2"), 4, DDP),
    ],
)
def test_one_decision_for_every_layout(flags, world_size, reduction):
    cfg = config(*flags, world_size=world_size)
    sync = data_parallel_mode(cfg).sync
    assert sync.reduction == reduction and sync.in_ddp == (reduction == DDP)
    assert sync.pipeline == (cfg.parallel.pipeline_model_parallel_size > 1)


EP2 = ("--expert-model-parallel-size", "2")


@pytest.mark.parametrize(
    "flags, world_size, expert_reduction",
    [
        (EP2, 4, True),
        (EP2, 2, True),
        ((*EP2, "--pipeline-model-parallel-size", "2"), 4, True),
        ((), 2, False),  # no expert-parallel shards: DDP or the flat all-reduce has them all
        (("--use-distributed-optimizer", *EP2), 4, False),
        (("--use-torch-fsdp2", *EP2), 4, False),
    ],
)
def test_each_mode_says_whether_the_expert_gradients_are_reduced_after_the_backward(
    flags, world_size, expert_reduction
):
    """A replicated model's expert shards are outside DDP and the flat all-reduce, so the sync
    averages them after the backward; the sharding modes reduce-scatter them themselves, and
    averaging them again would halve them."""
    sync = data_parallel_mode(config(*flags, world_size=world_size)).sync
    assert sync.reduces_expert_gradients == expert_reduction


@pytest.mark.parametrize(
    "flags, world_size, mode, shards, by_layer",
    [
        ((), 2, Replicated, (1, 1), (False, False)),
        (("--use-distributed-optimizer",), 4, ShardedOptimizerState, (4, 4), (False, False)),
        (
            ("--use-distributed-optimizer", "--expert-model-parallel-size", "2"),
            4,
            ShardedOptimizerState,
            (4, 2),
            (False, False),
        ),
        (
            ("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"),
            2,
            ShardedOptimizerState,
            (2, 2),
            (True, True),
        ),
        (("--use-torch-fsdp2",), 4, FullyShard, (4, 4), (True, False)),
        (
            ("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather")
            + ("--pipeline-model-parallel-size", "2"),
            4,
            ShardedOptimizerState,
            (2, 2),
            (True, False),
        ),
    ],
)
def test_one_data_parallel_mode_answers_the_trainer_and_the_planner(
    flags, world_size, mode, shards, by_layer
):
    """The mode parallelize builds, what it tells the planner (over how many ranks the dense
    and the expert optimizer state are divided) and whether it compiles and gathers layer by
    layer (a pipeline's schedules run the forwards, so its layers do not wait one by one)."""
    data_parallel = data_parallel_mode(config(*flags, world_size=world_size))
    assert type(data_parallel) is mode
    assert data_parallel.optimizer_shards() == shards
    assert (data_parallel.compiles_by_layer, data_parallel.gathers_by_layer) == by_layer


@pytest.mark.parametrize(
    "flags, holds",
    [
        ((), False),
        (("--use-distributed-optimizer",), True),
        (("--use-torch-fsdp2",), True),
    ],
)
@pytest.mark.parametrize("precision", [(), ("--bf16",), ("--fp16",)])
def test_one_answer_whether_the_weights_are_held_in_the_compute_dtype(flags, holds, precision):
    """The run's Numerics, told by its mode, give the one answer the distributed optimizer's
    buffers and the memory planner take: the sharding modes hold the weights in the compute
    dtype under autocast, no mode without; the mode built is the kind Numerics asked."""
    cfg = config(*flags, *precision, world_size=2)
    assert cfg.numerics.weights_in_compute_dtype == (holds and bool(precision))
    data_parallel = data_parallel_mode(cfg)
    assert data_parallel.kind is cfg.parallel.data_parallel_kind
    assert data_parallel.kind.holds_weights_in_compute_dtype == holds
    # The precision and optimizer flags alone do not know the mode.
    assert not Numerics.of(cfg.training, cfg.optimizer).weights_in_compute_dtype
