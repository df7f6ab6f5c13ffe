"""moe.overlapped_exchange on gloo: the same rows and gradients as the plain exchange
(moe.expert_parallel: dispatch, experts, combine), and the backward order that lets each
reverse all-to-all run while the rank's own rows are differentiated."""

from __future__ import annotations

import pytest
import torch

import moe.overlapped_exchange as overlapped
from moe.expert_parallel import ExpertExchange
from tests.launch import run_distributed

HIDDEN, LOCAL_EXPERTS = 6, 3


pytestmark = pytest.mark.usefixtures("reference_kernels")


class _Label(torch.autograd.Function):
    """Identity that logs `name` when its backward runs."""

    @staticmethod
    def forward(ctx, x, name, log):
        ctx.name, ctx.log = name, log
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(ctx.name)
        return grad, None, None


def _experts_runner(weights: torch.Tensor, log: list):
    """run(rows, row_weights, order, counts) of moe.overlapped_exchange with per-expert
    matrices, each output row scaled by its weight; the rows' backward is labelled 'own' when
    they arrive already sorted, else 'remote'."""

    def run(rows, row_weights, order, counts):
        if order is not None:  # permutations in fp64 (the layer's sum in fp32)
            rows = rows.index_select(0, order.long())
            row_weights = row_weights.index_select(0, order.long())
        name = "own" if order is None else "remote"
        rows = _Label.apply(rows, f"{name} backward", log)
        groups = rows.split(counts.tolist())
        out = torch.cat([group @ weights[e] for e, group in enumerate(groups)])
        out = out * row_weights.unsqueeze(-1)
        if order is not None:
            out = torch.zeros_like(out).index_copy(0, order.long(), out)
        return out

    return run


def _rank_inputs(rank: int, world_size: int):
    generator = torch.Generator().manual_seed(100 + rank)
    num_experts = LOCAL_EXPERTS * world_size
    counts = torch.randint(0, 5, (num_experts,), generator=generator)
    counts[rank] = 0  # an expert without rows from this rank
    rows = torch.randn(int(counts.sum()), HIDDEN, generator=generator, dtype=torch.float64)
    row_weights = torch.rand(int(counts.sum()), generator=generator, dtype=torch.float64)
    torch.manual_seed(7)  # the same full expert weights everywhere; each rank keeps its block
    full = torch.randn(num_experts, HIDDEN, HIDDEN, dtype=torch.float64)
    block = full[rank * LOCAL_EXPERTS : (rank + 1) * LOCAL_EXPERTS]
    return counts, rows, row_weights, block


def _compare(rank: int, world_size: int):
    counts, rows, row_weights, block = _rank_inputs(rank, world_size)
    results = {}
    for name in ("plain", "overlapped"):
        x = rows.clone().requires_grad_()
        scale = row_weights.clone().requires_grad_()
        weights = block.clone().requires_grad_()
        log: list = []
        run = _experts_runner(weights, log)
        if name == "plain":
            exchange = ExpertExchange.plan(counts, None)
            received = exchange.dispatch(x)
            received_scale = exchange.dispatch(scale.unsqueeze(-1)).squeeze(-1)
            out = run(
                received,
                received_scale,
                exchange.local_indices,
                exchange.tokens_per_local_expert,
            )
            out = exchange.combine(out)
        else:
            exchange = overlapped.OverlappedExchange.plan(counts, None)
            out = overlapped.run_experts_overlapped(x, scale, exchange, run)
        generator = torch.Generator().manual_seed(5 + rank)
        grad = torch.randn(out.shape, generator=generator, dtype=torch.float64)
        out.backward(grad)
        results[name] = (out.detach(), x.grad, scale.grad, weights.grad)
    return [(a - b).abs().max().item() for a, b in zip(results["plain"], results["overlapped"])]


@pytest.mark.parametrize("world_size", [2, 3])
def test_overlapped_exchange_matches_the_plain_exchange(world_size):
    for rank_errors in run_distributed(_compare, world_size):
        # outputs, row and row-weight gradients, expert weight gradients (fp64; summed in
        # another order)
        assert max(rank_errors) < 1e-12, rank_errors


def _backward_order(rank: int, world_size: int):
    counts, _, _, block = _rank_inputs(rank, world_size)
    counts += 2  # rows for every expert, so each stage of the schedule has work
    rows = torch.randn(int(counts.sum()), HIDDEN, dtype=torch.float64)
    row_weights = torch.rand(int(counts.sum()), dtype=torch.float64, requires_grad=True)
    log: list = []

    class _LoggedWork:
        def __init__(self, work, name):
            self.work, self.name = work, name

        def wait(self):
            log.append(f"wait {self.name}")
            return self.work.wait()

    original_start = overlapped._start
    starts = iter(
        ["dispatch", "dispatch weights", "combine", "reverse combine", "reverse dispatch",
         "reverse dispatch weights"]
    )  # fmt: skip

    def logged_start(x, output_splits, input_splits, group):
        out, work, sent = original_start(x, output_splits, input_splits, group)
        name = next(starts)
        log.append(f"start {name}")
        return out, _LoggedWork(work, name), sent

    overlapped._start = logged_start
    try:
        x = rows.requires_grad_()
        weights = block.clone().requires_grad_()
        exchange = overlapped.OverlappedExchange.plan(counts, None)
        run = _experts_runner(weights, log)
        out = overlapped.run_experts_overlapped(x, row_weights, exchange, run)
        log.append("forward done")
        out.sum().backward()
    finally:
        overlapped._start = original_start
    return log


def test_each_all_to_all_has_own_rows_to_overlap():
    # _Label logs in backward only: the forward half of the log shows the start/wait pairs.
    for log in run_distributed(_backward_order, 2):
        assert log == [
            "start dispatch",
            "start dispatch weights",
            "wait dispatch",
            "wait dispatch weights",
            "start combine",
            "wait combine",
            "forward done",
            "start reverse combine",
            "own backward",  # the second half of the own rows
            "wait reverse combine",
            "remote backward",
            "start reverse dispatch",
            "start reverse dispatch weights",
            "own backward",  # the first half
            "wait reverse dispatch",
            "wait reverse dispatch weights",
        ], log


def _exchanged_counts(rank: int, world_size: int):
    from moe.expert_parallel import exchange_counts

    # Rank s sends (s + 1) * (e + 1) rows to global expert e (2 local experts per rank).
    counts = torch.tensor([(rank + 1) * (e + 1) for e in range(2 * world_size)])
    exchanged = exchange_counts(counts, None)
    return (
        exchanged.received(),
        exchanged.send_splits,
        exchanged.receive_splits,
        exchanged.rows_received_per_rank,
        exchanged.imbalance,
    )


def test_count_exchange_gives_every_rank_the_splits_and_the_load_of_every_rank():
    world_size = 3
    sent = [[(s + 1) * (e + 1) for e in range(2 * world_size)] for s in range(world_size)]
    # Rows rank p receives from rank s: its two experts' counts in sent[s].
    between = [[sent[s][2 * p] + sent[s][2 * p + 1] for p in range(world_size)] for s in range(3)]
    per_rank = [sum(between[s][p] for s in range(world_size)) for p in range(world_size)]
    assert per_rank == [18, 42, 66]
    for rank, result in enumerate(run_distributed(_exchanged_counts, world_size)):
        received, send_splits, receive_splits, rows_per_rank, imbalance = result
        assert received == [sent[s][2 * rank : 2 * rank + 2] for s in range(world_size)]
        assert send_splits == between[rank]
        assert receive_splits == [between[s][rank] for s in range(world_size)]
        assert rows_per_rank == per_rank
        assert imbalance == pytest.approx(66 / 42)
    # Planned on the host, the local-expert-major permutation of the received rows.
    from moe.expert_parallel import expert_major_order

    received = [[2, 0], [1, 3], [0, 2]]  # [source][local expert]
    order = expert_major_order(received, torch.device("cpu")).tolist()
    # Source-major rows: s0e0 = 0, 1; s1e0 = 2; s1e1 = 3, 4, 5; s2e1 = 6, 7.
    assert order == [0, 1, 2, 3, 4, 5, 6, 7][:3] + [3, 4, 5, 6, 7]
    received = [[1, 2], [2, 1]]  # s0e0 = 0; s0e1 = 1, 2; s1e0 = 3, 4; s1e1 = 5
    assert expert_major_order(received, torch.device("cpu")).tolist() == [0, 3, 4, 1, 2, 5]


def _static_against_overlapped(rank: int, world_size: int, capacity: int):
    from moe import static_exchange

    counts, rows, row_weights, block = _rank_inputs(rank, world_size)
    results = {}
    for name in ("overlapped", "static"):
        x = rows.clone().requires_grad_()
        scale = row_weights.clone().requires_grad_()
        weights = block.clone().requires_grad_()
        run = _experts_runner(weights, [])
        if name == "overlapped":
            exchange = overlapped.OverlappedExchange.plan(counts, None)
            out = overlapped.run_experts_overlapped(x, scale, exchange, run)
            overflow = None
        else:
            exchange = static_exchange.StaticExchange.plan(counts, x.shape[0], capacity, None)
            out = static_exchange.run_experts_static(x, scale, exchange, run)
            overflow = bool(exchange.overflowed())
        generator = torch.Generator().manual_seed(5 + rank)
        grad = torch.randn(out.shape, generator=generator, dtype=torch.float64)
        out.backward(grad)
        results[name] = (out.detach(), x.grad, scale.grad, weights.grad)
    errors = [(a - b).abs().max().item() for a, b in zip(results["overlapped"], results["static"])]
    return errors, overflow


@pytest.mark.parametrize("world_size", [2, 3])
def test_static_exchange_matches_the_overlapped_exchange(world_size):
    """Fixed-size blocks (padding included) give the same rows and gradients; a capacity too
    small for the busiest block is flagged on every rank."""
    for errors, overflow in run_distributed(_static_against_overlapped, world_size, 40):
        assert max(errors) < 1e-12 and not overflow, errors
    flags = [overflow for _, overflow in run_distributed(_static_against_overlapped, world_size, 2)]
    assert all(flags), flags
