"""DistributedOptimizer (ZeRO-1) against MegatronOptimizer in one process: training parity at
DP=2 and DP=3 (uneven padding, parameters straddling shards), the fp16 overflow skip, shard
and full-state checkpoints across DP sizes, and the memory report."""

from __future__ import annotations

import copy
import functools
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatron.config import OptimizerConfig, TrainingConfig
from megatron.optimizer import build_lr_scheduler, build_optimizer
from megatron.optimizer.distributed_optimizer import build_distributed_optimizer
from tests.launch import run_distributed

GLOBAL_BATCH = 6  # rows per step, split evenly over 1, 2 or 3 data-parallel ranks
STEPS = 5
CHECKPOINT_STEP = 3
TOLERANCE = 1e-5


def tiny_model(seed: int = 0) -> nn.Module:
    """80 parameter elements: not a multiple of 3, and tensors straddle shard boundaries."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.GELU(), nn.Linear(7, 3))


def optimizer_config(name: str, **overrides: Any) -> OptimizerConfig:
    """Weight decay and clipping active (the norms are ~0.2-0.9); lr changes every step."""
    fields: Dict[str, Any] = dict(
        lr=0.05,
        min_lr=0.005,
        weight_decay=0.1,
        clip_grad=0.3,
        lr_warmup_iters=2,
        lr_decay_iters=8,
        lr_decay_style="cosine",
    )
    if name == "sgd":
        fields.update(optimizer="sgd", sgd_momentum=0.9)
    fields.update(overrides)
    return OptimizerConfig(**fields)


def training_config(**overrides: Any) -> TrainingConfig:
    fields: Dict[str, Any] = dict(
        micro_batch_size=2, global_batch_size=GLOBAL_BATCH, num_micro_batches=1, train_iters=8
    )
    fields.update(overrides)
    return TrainingConfig(**fields)


def batch(step: int, rank: int = 0, world_size: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the global batch of `step`."""
    generator = torch.Generator().manual_seed(100 + step)
    inputs = torch.randn(GLOBAL_BATCH, 5, generator=generator)
    targets = torch.randn(GLOBAL_BATCH, 3, generator=generator)
    rows = GLOBAL_BATCH // world_size
    return inputs[rank * rows : (rank + 1) * rows], targets[rank * rows : (rank + 1) * rows]


def train(
    model: nn.Module, optimizer, scheduler, steps: range, rank: int = 0, world_size: int = 1
) -> List[Tuple[float, float]]:
    """(mean loss over the global batch, grad norm) per step."""
    records = []
    for step in steps:
        inputs, targets = batch(step, rank, world_size)
        optimizer.zero_grad()
        loss = (model(inputs) - targets).square().mean()
        optimizer.scale_loss(loss).backward()
        update_successful, grad_norm, _ = optimizer.step()
        assert update_successful
        scheduler.step(increment=GLOBAL_BATCH)
        global_loss = loss.detach().clone()
        if world_size > 1:
            dist.all_reduce(global_loss)
        records.append((global_loss.item() / world_size, grad_norm))
    return records


def parameters(model: nn.Module) -> List[torch.Tensor]:
    return [param.detach().clone() for param in model.parameters()]


def assert_close(first: List[torch.Tensor], second: List[torch.Tensor]) -> None:
    assert len(first) == len(second)
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, atol=TOLERANCE, rtol=0.0)


@functools.cache
def reference(name: str) -> Dict[str, Any]:
    """One process, MegatronOptimizer on the whole batch; a snapshot at CHECKPOINT_STEP."""
    model = tiny_model()
    optimizer = build_optimizer(model, optimizer_config(name), training_config())
    scheduler = build_lr_scheduler(optimizer, optimizer_config(name), training_config())
    records = train(model, optimizer, scheduler, range(CHECKPOINT_STEP))
    snapshot = {
        "model": copy.deepcopy(model.state_dict()),
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "scheduler": scheduler.state_dict(),
    }
    records += train(model, optimizer, scheduler, range(CHECKPOINT_STEP, STEPS))
    return {"records": records, "params": parameters(model), "snapshot": snapshot}


def build_distributed(name: str, seed: int):
    model = tiny_model(seed)
    optimizer = build_distributed_optimizer(model, optimizer_config(name), training_config())
    scheduler = build_lr_scheduler(optimizer, optimizer_config(name), training_config())
    return model, optimizer, scheduler


def _train_distributed(rank: int, world_size: int, name: str) -> Dict[str, Any]:
    # Each rank starts from other weights: the optimizer must broadcast rank 0's (seed 0).
    model, optimizer, scheduler = build_distributed(name, seed=rank)
    report = optimizer.memory_report()
    records = train(model, optimizer, scheduler, range(STEPS), rank, world_size)
    measured_state_bytes = sum(
        value.numel() * value.element_size()
        for entry in optimizer.optimizer.state.values()
        for value in entry.values()
        if torch.is_tensor(value) and value.dim() > 0
    )
    return {
        "records": records,
        "params": parameters(model),
        "report": report,
        "measured_state_bytes": measured_state_bytes,
    }


@functools.cache
def distributed_run(name: str, world_size: int) -> List[Dict[str, Any]]:
    return run_distributed(_train_distributed, world_size, name)


@pytest.mark.parametrize("name, world_size", [("adam", 2), ("sgd", 2), ("adam", 3), ("sgd", 3)])
def test_matches_one_process_on_the_whole_batch(name: str, world_size: int):
    expected = reference(name)
    assert all(norm > optimizer_config(name).clip_grad for _, norm in expected["records"])
    for result in distributed_run(name, world_size):
        for (loss, norm), (expected_loss, expected_norm) in zip(
            result["records"], expected["records"]
        ):
            assert loss == pytest.approx(expected_loss, abs=TOLERANCE)
            assert norm == pytest.approx(expected_norm, abs=TOLERANCE)
        assert_close(result["params"], expected["params"])


@pytest.mark.parametrize("world_size", [2, 3])
def test_memory_report_shows_a_dp_th_of_the_state_per_rank(world_size: int):
    results = distributed_run("adam", world_size)
    reports = [result["report"] for result in results]
    parameters_total = reports[0].parameters
    assert parameters_total == sum(p.numel() for p in tiny_model().parameters())
    assert sum(report.local_parameters for report in reports) == parameters_total
    shard_size = -(-parameters_total // world_size)
    for result, report in zip(results, reports):
        assert report.data_parallel_size == world_size
        assert report.state_bytes_unsharded == 2 * 4 * parameters_total  # exp_avg, exp_avg_sq
        # Each rank holds ceil(N / dp) elements of master weights and Adam state, the last
        # one fewer where the padding goes.
        assert report.local_parameters in (
            shard_size,
            parameters_total - shard_size * (world_size - 1),
        )
        assert report.bytes_per_rank == 3 * 4 * report.local_parameters
        assert report.bytes_per_rank * world_size == pytest.approx(
            report.bytes_unsharded, abs=3 * 4 * world_size
        )
        assert result["measured_state_bytes"] == report.state_bytes_per_rank
        assert "saving" in str(report)


def _overflow(rank: int, world_size: int) -> Dict[str, Any]:
    config = optimizer_config("adam", initial_loss_scale=2.0**8, hysteresis=1)
    model = tiny_model()
    optimizer = build_distributed_optimizer(
        model, config, training_config(fp16=True), log_num_zeros_in_grad=True
    )
    inputs, targets = batch(0, rank, world_size)
    optimizer.zero_grad()
    optimizer.scale_loss((model(inputs) - targets).square().mean()).backward()
    if rank == 1:
        # Element 0 of the buffer lies in rank 0's shard: rank 1's own shard stays finite.
        model[0].weight.grad[0, 0] = float("inf")
    before = parameters(model)
    skipped = optimizer.step()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, parameters(model)))
    scale_after_skip = optimizer.loss_scale
    optimizer.zero_grad()
    optimizer.scale_loss((model(inputs) - targets).square().mean()).backward()
    # The second weight (21 elements) straddles the DP=2 shard boundary; its zeros are counted
    # on both ranks and summed.
    model[3].weight.grad.zero_()
    stepped = optimizer.step()
    changed = not all(torch.equal(a, b) for a, b in zip(before, parameters(model)))
    return {
        "skipped": skipped,
        "unchanged": unchanged,
        "scale_after_skip": scale_after_skip,
        "stepped": stepped[0],
        "num_zeros_in_grad": stepped[2],
        "changed": changed,
    }


def test_fp16_overflow_on_one_rank_skips_on_every_rank():
    for result in run_distributed(_overflow, 2):
        assert result["skipped"] == (False, None, None)
        assert result["unchanged"]
        assert result["scale_after_skip"] == 2.0**7
        assert result["stepped"] and result["changed"]
        assert result["num_zeros_in_grad"] == 21


def _train_and_gather(rank: int, world_size: int) -> Dict[str, Any]:
    model, optimizer, scheduler = build_distributed("adam", seed=0)
    train(model, optimizer, scheduler, range(CHECKPOINT_STEP), rank, world_size)
    return {
        "model": copy.deepcopy(model.state_dict()),
        "optimizer": optimizer.gather_full_state_dict(),
        "scheduler": scheduler.state_dict(),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_full_state_gathered_at_dp_n_continues_in_one_process(world_size: int):
    expected = reference("adam")
    saved = run_distributed(_train_and_gather, world_size)[0]
    expected_state = expected["snapshot"]["optimizer"]["optimizer"]
    gathered_state = saved["optimizer"]["optimizer"]
    assert gathered_state["param_groups"] == expected_state["param_groups"]
    assert gathered_state["state"].keys() == expected_state["state"].keys()
    for index, entry in expected_state["state"].items():
        assert gathered_state["state"][index].keys() == entry.keys()
        for key, value in entry.items():
            torch.testing.assert_close(
                gathered_state["state"][index][key], value, atol=1e-6, rtol=0
            )

    model = tiny_model(seed=7)
    model.load_state_dict(saved["model"])
    optimizer = build_optimizer(model, optimizer_config("adam"), training_config())
    optimizer.load_state_dict(saved["optimizer"])
    scheduler = build_lr_scheduler(optimizer, optimizer_config("adam"), training_config())
    scheduler.load_state_dict(saved["scheduler"])
    records = train(model, optimizer, scheduler, range(CHECKPOINT_STEP, STEPS))
    assert_close(parameters(model), expected["params"])
    for (_, norm), (_, expected_norm) in zip(records, expected["records"][CHECKPOINT_STEP:]):
        assert norm == pytest.approx(expected_norm, abs=TOLERANCE)


def _resume_from_full(rank: int, world_size: int, saved: Dict[str, Any]) -> List[torch.Tensor]:
    model, optimizer, scheduler = build_distributed("adam", seed=rank)
    model.load_state_dict(saved["model"])  # copies into the flat buffer the optimizer owns
    optimizer.load_full_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    train(model, optimizer, scheduler, range(CHECKPOINT_STEP, STEPS), rank, world_size)
    return parameters(model)


@pytest.mark.parametrize("world_size", [2, 3])
def test_one_process_state_loads_into_dp_n_shards(world_size: int):
    expected = reference("adam")
    for params in run_distributed(_resume_from_full, world_size, expected["snapshot"]):
        assert_close(params, expected["params"])


def _shard_round_trip(rank: int, world_size: int) -> Dict[str, Any]:
    model, optimizer, scheduler = build_distributed("adam", seed=0)
    train(model, optimizer, scheduler, range(CHECKPOINT_STEP), rank, world_size)
    saved = copy.deepcopy(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
        }
    )
    train(model, optimizer, scheduler, range(CHECKPOINT_STEP, STEPS), rank, world_size)

    resumed, resumed_optimizer, resumed_scheduler = build_distributed("adam", seed=rank + 10)
    resumed.load_state_dict(saved["model"])
    resumed_optimizer.load_state_dict(saved["optimizer"])
    resumed_scheduler.load_state_dict(saved["scheduler"])
    train(
        resumed,
        resumed_optimizer,
        resumed_scheduler,
        range(CHECKPOINT_STEP, STEPS),
        rank,
        world_size,
    )

    wrong_layout = copy.deepcopy(saved["optimizer"])
    wrong_layout["shard_layout"]["data_parallel_size"] = world_size + 1
    try:
        resumed_optimizer.load_state_dict(wrong_layout)
        error = ""
    except ValueError as raised:
        error = str(raised)
    return {"original": parameters(model), "resumed": parameters(resumed), "error": error}


def test_shard_state_dict_round_trip_at_the_same_dp_size():
    for result in run_distributed(_shard_round_trip, 2):
        for a, b in zip(result["original"], result["resumed"]):
            assert torch.equal(a, b)
        assert "gather_full_state_dict" in result["error"]


def test_one_rank_grads_accumulate_in_the_buffer_or_are_copied_in():
    """DP=1 needs no process group; grads the trainer re-creates are still picked up."""
    expected = reference("sgd")
    model, optimizer, scheduler = build_distributed("sgd", seed=0)
    buffer = optimizer.buffers[0]
    # One rank reduces nothing: the step reads the grad buffer itself, not a copy of it.
    assert buffer.shard_grad.data_ptr() == buffer.grad_buffer.data_ptr()
    for step in range(STEPS):
        inputs, targets = batch(step)
        if step % 2:
            optimizer.zero_grad()
        else:
            model.zero_grad(set_to_none=True)  # autograd allocates fresh grads outside the buffer
        (model(inputs) - targets).square().mean().backward()
        in_buffer = model[0].weight.grad.data_ptr() == buffer.grad_buffer.data_ptr()
        assert in_buffer == bool(step % 2)
        optimizer.step()
        scheduler.step(increment=GLOBAL_BATCH)
    assert_close(parameters(model), expected["params"])
