"""--overlap-grad-reduce (megatron.optimizer.grad_reduce): how parameters are cut into buckets,
and on 2 and 3 gloo ranks that every bucket is reduce-scattered during the last micro-batch's
backward (none during the others), gradients a layer adds itself (the dMoE's expert-weight
copies) included, with the distributed optimizer's result without overlap (bit for bit on 2
ranks) and one process's; a step run again reduces only its last run. End to end (pretrain_gpt.py, sequence and expert parallelism) in
tests/distributed/test_distributed_optimizer_parallel.py."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatron.optimizer import build_lr_scheduler, build_optimizer
from megatron.optimizer.distributed_optimizer import build_distributed_optimizer
from megatron.optimizer.grad_reduce import bucket_parameters, default_bucket_size
from megatron.tensor_parallel.layers import set_sequence_parallel_attribute
from moe.weight_copies import GradientAccumulator
from tests.distributed.launch import run_distributed
from tests.distributed.test_distributed_optimizer import optimizer_config, training_config

ROWS = 6  # per micro-batch of the whole batch, split over 1, 2 or 3 ranks
MICRO_BATCHES = 2
STEPS = 3


class CopiedLinear(nn.Module):
    """A projection that computes with a copy of its weight and adds the copy's gradients
    into the weight itself, two micro-batches at a time, as the dMoE's experts do
    (moe.weight_copies.GradientAccumulator): the weight never gets a gradient from autograd."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(features, features) / features)
        self.accumulator = GradientAccumulator(self.weight)
        self.copy = None

    def refresh(self) -> None:
        self.accumulator.flush()
        self.copy = self.weight.detach().clone().requires_grad_(True)
        self.copy.register_post_accumulate_grad_hook(self.accumulator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.copy


def model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(5, 8), nn.GELU(), CopiedLinear(8), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 3)
    )


def micro_batch(step: int, index: int, rank: int, world_size: int):
    generator = torch.Generator().manual_seed(1000 * step + index)
    inputs, targets = (
        torch.randn(ROWS, 5, generator=generator),
        torch.randn(ROWS, 3, generator=generator),
    )
    rows = ROWS // world_size
    return inputs[rank * rows : (rank + 1) * rows], targets[rank * rows : (rank + 1) * rows]


def _train(rank: int, world_size: int, kind: str) -> Dict[str, Any]:
    """kind: 'one' (MegatronOptimizer, one process), 'sharded' or 'overlapped' (the
    distributed optimizer without and with overlap, 10-element buckets)."""
    net = model(seed=rank)
    config = optimizer_config("adam")
    training = training_config(num_micro_batches=MICRO_BATCHES)
    if kind == "one":
        optimizer = build_optimizer(net, config, training)
    else:
        overlap = kind == "overlapped"
        optimizer = build_distributed_optimizer(
            net, config, training, overlap_grad_reduce=overlap, bucket_size=10 if overlap else None
        )
    scheduler = build_lr_scheduler(optimizer, config, training)
    launched: List[List[int]] = []
    # When the backward reaches the first layer, every bucket but the ones holding its weight
    # and bias must be on their way already.
    before_first_layer: List[int] = []
    if kind == "overlapped":
        net[0].register_full_backward_pre_hook(
            lambda *_: before_first_layer.append(optimizer.grad_reduce.launched_buckets())
        )
    for step in range(STEPS):
        net[2].refresh()
        optimizer.zero_grad()
        counts = []
        for index in range(MICRO_BATCHES):
            if index == MICRO_BATCHES - 1:
                optimizer.last_backward_starts()
            inputs, targets = micro_batch(step, index, rank, world_size)
            loss = (net(inputs) - targets).square().mean() / MICRO_BATCHES
            loss.backward()
            if kind == "overlapped":
                counts.append(optimizer.grad_reduce.launched_buckets())
        launched.append(counts)
        net[2].accumulator.flush()
        assert optimizer.step()[0]
        scheduler.step(increment=ROWS * MICRO_BATCHES)
    return {
        "params": [param.detach().clone() for param in net.parameters()],
        "launched": launched,
        "before_first_layer": before_first_layer,
        "buckets": len(getattr(optimizer, "buffers", [])),
    }


def test_buckets_fill_in_backward_order_and_leave_late_gradients_last():
    params = [nn.Parameter(torch.zeros(size)) for size in (4, 3, 5, 2, 6)]
    set_sequence_parallel_attribute(params[1])
    sizes = lambda buckets: [[param.numel() for param in bucket] for bucket in buckets]  # noqa: E731
    # Closed once they hold 6 or more, from the last parameter back; the norm's own bucket last.
    assert sizes(bucket_parameters(params, 6)) == [[6], [2, 5], [4], [3]]
    assert sizes(bucket_parameters(params, 100)) == [[6, 2, 5, 4], [3]]
    assert bucket_parameters(params, None) == [params]
    assert default_bucket_size(8) == 40_000_000 and default_bucket_size(64) == 64_000_000


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_bucket_reduces_during_the_last_backward(world_size: int):
    one = run_distributed(_train, 1, "one")[0]
    sharded = run_distributed(_train, world_size, "sharded")
    overlapped = run_distributed(_train, world_size, "overlapped")
    for plain, result in zip(sharded, overlapped):
        assert result["buckets"] > 3
        # None after the first micro-batch's backward; all of them after the last one's, the
        # copied weight's (written by its accumulator) included, before the step waits.
        assert result["launched"] == [[0, result["buckets"]]] * STEPS
        # Buckets of 10 from the last parameter back: [3, 24], [8, 64], [64] (the copied
        # weight), [8, 40] (the first layer's bias and weight, not written yet); the first
        # micro-batch's backward launches none.
        assert result["before_first_layer"] == [0, 3] * STEPS
        for expected, actual, reference in zip(plain["params"], result["params"], one["params"]):
            # Two ranks' sums are exact in any order; three ranks' may round otherwise when
            # the collective is cut into other chunks.
            exact = dict(rtol=0, atol=0) if world_size == 2 else dict(rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(actual, expected, **exact)
            torch.testing.assert_close(actual, reference, rtol=0, atol=1e-6)


def _rerun_drops_the_first_reductions(rank: int, world_size: int) -> List[torch.Tensor]:
    """A step whose backward ran twice (the trainer's rerun zeroes the gradients and runs the
    micro-batches again): the reductions of the first run are waited for and dropped."""
    net = model()
    config, training = optimizer_config("sgd"), training_config(num_micro_batches=1)
    optimizer = build_distributed_optimizer(
        net, config, training, overlap_grad_reduce=True, bucket_size=10
    )
    net[2].refresh()
    for scale in (100.0, 1.0):
        optimizer.zero_grad()
        optimizer.last_backward_starts()
        inputs, targets = micro_batch(0, 0, rank, world_size)
        (scale * (net(inputs) - targets).square().mean()).backward()
        net[2].accumulator.flush()
    optimizer.step()
    return [param.detach().clone() for param in net.parameters()]


def test_a_step_run_again_reduces_only_its_last_run():
    once = run_distributed(_train_once_sgd, 2)
    again = run_distributed(_rerun_drops_the_first_reductions, 2)
    for expected, actual in zip(once[0], again[0]):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def _train_once_sgd(rank: int, world_size: int) -> List[torch.Tensor]:
    net = model()
    config, training = optimizer_config("sgd"), training_config(num_micro_batches=1)
    optimizer = build_distributed_optimizer(
        net, config, training, overlap_grad_reduce=True, bucket_size=10
    )
    net[2].refresh()
    optimizer.zero_grad()
    optimizer.last_backward_starts()
    inputs, targets = micro_batch(0, 0, rank, world_size)
    (net(inputs) - targets).square().mean().backward()
    net[2].accumulator.flush()
    optimizer.step()
    dist.barrier()
    return [param.detach().clone() for param in net.parameters()]
