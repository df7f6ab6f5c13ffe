"""--overlap-grad-reduce (megatron.optimizer.grad_reduce): how parameters are cut into buckets,
and on 2 and 3 gloo ranks that every bucket is reduce-scattered during the last micro-batch's
backward (none during the others), gradients a layer adds itself (the dMoE's expert-weight
copies) included, with the distributed optimizer's result without overlap (bit for bit on 2
ranks) and one process's; a step run again reduces only its last run. End to end (pretrain_gpt.py, sequence and expert parallelism) in
tests/optimizer/test_distributed_optimizer_parallel.py."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatron.model import DENSE_MLP, GPTModel
from megatron.optimizer import build_lr_scheduler, build_optimizer
from megatron.optimizer.distributed_optimizer import build_distributed_optimizer
from megatron.optimizer.grad_reduce import bucket_parameters, default_bucket_size
from megatron.parallelize.data_parallel import install_parameter_waits
from megatron.tensor_parallel.layers import set_sequence_parallel_attribute
from megatron.training.hooks import TrainingHooks
from moe.weight_copies import GradientAccumulator
from tests.launch import run_distributed
from tests.optimizer.test_distributed_optimizer import optimizer_config, training_config
from tests.tiny_gpt import tiny_model_config

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
        overlap = kind in ("overlapped", "gathered")
        optimizer = build_distributed_optimizer(
            net,
            config,
            training,
            overlap_grad_reduce=overlap,
            bucket_size=10 if overlap else None,
            overlap_param_gather=kind == "gathered",
        )
    in_flight_after_step: List[int] = []
    if kind == "gathered":
        # As the trainer does for transformer layers: each module waits for its own weights.
        for module in net:
            module.register_forward_pre_hook(
                lambda module, _: optimizer.wait_for_parameters(module.parameters())
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
        if step > 0 and kind == "gathered":
            assert optimizer.param_gather.pending() == 3  # the copied weight's bucket waited
        net[2].refresh()
        optimizer.zero_grad()
        counts = []
        for index in range(MICRO_BATCHES):
            if index == MICRO_BATCHES - 1 and kind != "one":
                optimizer.last_backward_starts()
            inputs, targets = micro_batch(step, index, rank, world_size)
            loss = (net(inputs) - targets).square().mean() / MICRO_BATCHES
            loss.backward()
            if kind == "overlapped":
                counts.append(optimizer.grad_reduce.launched_buckets())
        launched.append(counts)
        net[2].accumulator.flush()
        assert optimizer.step()[0]
        if kind == "gathered":
            in_flight_after_step.append(optimizer.param_gather.pending())
        scheduler.step(increment=ROWS * MICRO_BATCHES)
        if kind != "one":
            optimizer.wait_for_parameters(net[2].parameters())  # the copy is refreshed from it
    if kind != "one":
        optimizer.finish_parameter_gather()
    return {
        "params": [param.detach().clone() for param in net.parameters()],
        "launched": launched,
        "before_first_layer": before_first_layer,
        "in_flight_after_step": in_flight_after_step,
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


@pytest.mark.parametrize("world_size", [2, 3])
def test_parameters_gathered_in_flight_arrive_before_their_forward(world_size: int):
    """--overlap-param-gather: after each step every bucket's all-gather is in flight (none
    waited for), each module waits for its own just before its forward, and training gives
    the distributed optimizer's result without it."""
    sharded = run_distributed(_train, world_size, "overlapped")
    gathered = run_distributed(_train, world_size, "gathered")
    for plain, result in zip(sharded, gathered):
        assert result["in_flight_after_step"] == [result["buckets"]] * STEPS
        for expected, actual in zip(plain["params"], result["params"]):
            torch.testing.assert_close(actual, expected, rtol=0, atol=0)


class ArrivingParameters:
    """Stands in for the distributed optimizer with its all-gather in flight: every parameter
    is NaN until waited for, and each wait records the latest gather position it needed
    (buckets are gathered in the model's order, the reverse of `bucket_parameters`')."""

    def __init__(self, model: nn.Module, bucket_size: int) -> None:
        self.params = list(model.parameters())
        self.values = {id(param): param.detach().clone() for param in self.params}
        buckets = bucket_parameters(self.params, bucket_size)
        self.position = {
            id(param): len(buckets) - 1 - index
            for index, bucket in enumerate(buckets)
            for param in bucket
        }
        self.waited: List[int] = []

    @torch.no_grad()
    def scatter(self) -> None:
        for param in self.params:
            param.fill_(float("nan"))
        self.waited = []

    @torch.no_grad()
    def wait_for_parameters(self, params) -> None:
        params = list(params)
        for param in params:
            param.copy_(self.values[id(param)])
        if params:
            self.waited.append(max(self.position[id(param)] for param in params))


@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untied"])
def test_every_module_waits_for_its_parameters_in_gather_order(untie: bool):
    """The trainer's waits (megatron.parallelize.data_parallel.install_parameter_waits) on a GPT whose
    parameters all arrive only when waited for: the forward reads none before its wait (the
    logits stay finite and equal the model's), and the waits follow the gather order, so none
    waits behind a bucket it does not need yet (the untied output layer's weight, read by the
    model without calling the layer, is waited for after the decoder)."""
    config = tiny_model_config(untie_embeddings_and_output_weights=untie)
    torch.manual_seed(0)
    net = GPTModel(config, DENSE_MLP)
    tokens = torch.randint(0, config.padded_vocab_size, (2, 8))
    expected = net(tokens)
    arriving = ArrivingParameters(net, bucket_size=20_000)
    install_parameter_waits(net, arriving.wait_for_parameters, TrainingHooks().before_layer_forward)
    for _ in range(2):
        arriving.scatter()
        torch.testing.assert_close(net(tokens), expected, rtol=0, atol=0)
        assert arriving.waited == sorted(arriving.waited)
        assert arriving.waited[0] == 0 and arriving.waited[-1] == max(arriving.position.values())
