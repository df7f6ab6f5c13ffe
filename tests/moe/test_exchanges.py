"""moe.exchange on gloo: the exact exchange and the fixed-size blocks (in one exchange and in
chunks) give the plain exchange's rows and gradients (dispatch, experts, combine, built here
from moe.exchange.primitives), and each all-to-all is waited only after the computation it
should hide behind was issued, forward and backward."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moe.exchange.exact as exact
from moe.exchange import fixed_blocks
from moe.exchange.primitives import all_to_all, exchange_counts, expert_major_order, host_counts
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


def _experts_runner(weights: torch.Tensor, log: list, names=None):
    """run(rows, row_weights, order, counts) of moe.exchange with per-expert matrices, each
    output row scaled by its weight, rows past the groups (padding) left as zeros; the rows'
    backward is labelled 'own' when they arrive already sorted, else 'remote' (or by `names`,
    one per call, which the forward logs too)."""
    names = iter(names) if names is not None else None

    def run(rows, row_weights, order, counts):
        if order is not None:  # permutations in fp64 (the layer's sum in fp32)
            rows = rows.index_select(0, order.long())
            row_weights = row_weights.index_select(0, order.long())
        name = ("own" if order is None else "remote") if names is None else next(names)
        if names is not None:
            log.append(f"{name} forward")
        rows = _Label.apply(rows, f"{name} backward", log)
        sizes = counts.tolist()
        groups = rows.split(sizes + [rows.shape[0] - sum(sizes)])
        out = torch.cat(
            [group @ weights[e] for e, group in enumerate(groups[:-1])]
            + [torch.zeros_like(groups[-1])]
        )
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


def _plain_exchange(x, scale, counts, run):
    """Dispatch, experts, combine: the exchange every other one must equal."""
    exchanged = exchange_counts(counts, None)
    send, receive = exchanged.send_splits, exchanged.receive_splits
    received = exchanged.received()
    received_rows = all_to_all(x, receive, send)
    received_scale = all_to_all(scale.unsqueeze(-1), receive, send).squeeze(-1)
    order = expert_major_order(received, x.device)
    per_expert = host_counts([sum(c) for c in zip(*received)], x.device)
    return all_to_all(run(received_rows, received_scale, order, per_expert), send, receive)


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
            out = _plain_exchange(x, scale, counts, run)
        else:
            exchange = exact.ExactExchange.plan(counts, None)
            out = exact.run_experts_exactly(x, scale, exchange, run)
        generator = torch.Generator().manual_seed(5 + rank)
        grad = torch.randn(out.shape, generator=generator, dtype=torch.float64)
        out.backward(grad)
        results[name] = (out.detach(), x.grad, scale.grad, weights.grad)
    return [(a - b).abs().max().item() for a, b in zip(results["plain"], results["overlapped"])]


@pytest.mark.parametrize("world_size", [2, 3])
def test_exact_exchange_matches_the_plain_exchange(world_size):
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

    original_start = exact._start
    starts = iter(
        ["dispatch", "dispatch weights", "combine", "reverse combine", "reverse dispatch",
         "reverse dispatch weights"]
    )  # fmt: skip

    def logged_start(x, output_splits, input_splits, group):
        out, work, sent = original_start(x, output_splits, input_splits, group)
        name = next(starts)
        log.append(f"start {name}")
        return out, _LoggedWork(work, name), sent

    exact._start = logged_start
    try:
        x = rows.requires_grad_()
        weights = block.clone().requires_grad_()
        exchange = exact.ExactExchange.plan(counts, None)
        run = _experts_runner(weights, log)
        out = exact.run_experts_exactly(x, row_weights, exchange, run)
        log.append("forward done")
        out.sum().backward()
    finally:
        exact._start = original_start
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
    received = [[2, 0], [1, 3], [0, 2]]  # [source][local expert]
    order = expert_major_order(received, torch.device("cpu")).tolist()
    # Source-major rows: s0e0 = 0, 1; s1e0 = 2; s1e1 = 3, 4, 5; s2e1 = 6, 7.
    assert order == [0, 1, 2, 3, 4, 5, 6, 7][:3] + [3, 4, 5, 6, 7]
    received = [[1, 2], [2, 1]]  # s0e0 = 0; s0e1 = 1, 2; s1e0 = 3, 4; s1e1 = 5
    assert expert_major_order(received, torch.device("cpu")).tolist() == [0, 3, 4, 1, 2, 5]


def _fixed_blocks_against_exact(
    rank: int, world_size: int, capacity: int, chunks: int, padding_in_groups: bool
):
    counts, rows, row_weights, block = _rank_inputs(rank, world_size)
    results = {}
    for name in ("exact", "fixed blocks"):
        x = rows.clone().requires_grad_()
        scale = row_weights.clone().requires_grad_()
        weights = block.clone().requires_grad_()
        run = _experts_runner(weights, [])
        if name == "exact":
            exchange = exact.ExactExchange.plan(counts, None)
            out = exact.run_experts_exactly(x, scale, exchange, run)
            overflow = None
        else:
            exchange = fixed_blocks.FixedBlockExchange.plan(
                counts, x.shape[0], capacity, None, chunks
            )
            out = fixed_blocks.run_experts_in_blocks(x, scale, exchange, run, padding_in_groups)
            overflow = bool(exchange.overflowed())
        generator = torch.Generator().manual_seed(5 + rank)
        grad = torch.randn(out.shape, generator=generator, dtype=torch.float64)
        out.backward(grad)
        results[name] = (out.detach(), x.grad, scale.grad, weights.grad)
    errors = [(a - b).abs().max().item() for a, b in zip(results["exact"], results["fixed blocks"])]
    return errors, overflow


@pytest.mark.parametrize("world_size", [2, 3])
def test_fixed_blocks_match_the_exact_exchange(world_size):
    """Fixed-size blocks, padding in no group or in the last one, in one exchange or in chunks
    (one chunk of a block all padding), give the same rows and gradients; a capacity too small
    for the busiest block is flagged on every rank."""
    for chunks, padding_in_groups in ((1, False), (1, True), (2, False), (5, True)):
        args = (40, chunks, padding_in_groups)
        for errors, overflow in run_distributed(_fixed_blocks_against_exact, world_size, *args):
            assert max(errors) < 1e-12 and not overflow, (chunks, errors)
    small = run_distributed(_fixed_blocks_against_exact, world_size, 2, 2, False)
    assert all(overflow for _, overflow in small), small


class _CollectiveLog(TorchDispatchMode):
    """Logs each all-to-all as it is issued and as it is waited for, named by `names` in the
    order of issue (the forward's, then the backward's)."""

    def __init__(self, log: list, names: list):
        super().__init__()
        self.log, self.names, self.in_flight = log, iter(names), {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops._c10d_functional.all_to_all_single.default:
            name = next(self.names)
            self.in_flight[out.untyped_storage().data_ptr()] = name
            self.log.append(f"issue {name}")
        elif func is torch.ops._c10d_functional.wait_tensor.default:
            name = self.in_flight.pop(args[0].untyped_storage().data_ptr(), None)
            if name is not None:
                self.log.append(f"wait {name}")
        return out


def _chunk_schedule(rank: int, world_size: int, chunks: int):
    counts, rows, row_weights, block = _rank_inputs(rank, world_size)
    counts += 2  # rows for every expert in every chunk
    rows = torch.randn(int(counts.sum()), HIDDEN, dtype=torch.float64, requires_grad=True)
    row_weights = torch.rand(int(counts.sum()), dtype=torch.float64, requires_grad=True)
    weights = block.clone().requires_grad_()
    log: list = []
    run = _experts_runner(weights, log, [f"experts {k}" for k in range(chunks)])
    forward = [f"{what} {k}" for k in range(chunks) for what in ("dispatch", "dispatch weights")]
    forward += [f"combine {k}" for k in range(chunks)]
    backward = [f"reverse combine {k}" for k in reversed(range(chunks))]
    for k in reversed(range(chunks)):
        backward += [f"reverse dispatch weights {k}", f"reverse dispatch {k}"]
    exchange = fixed_blocks.FixedBlockExchange.plan(counts, rows.shape[0], 64, None, chunks)
    with _CollectiveLog(log, forward + backward):
        out = fixed_blocks.run_experts_in_blocks(rows, row_weights, exchange, run)
        out.sum().backward()
    return log


def _hidden(log: list) -> list:
    """The exchanges waited for after some expert computation issued after them."""
    hidden = []
    for position, entry in enumerate(log):
        if not entry.startswith("wait "):
            continue
        name = entry[len("wait ") :]
        issued = log.index(f"issue {name}")
        if any(e.startswith("experts ") for e in log[issued:position]):
            hidden.append(name)
    return hidden


def test_chunked_exchange_waits_after_the_work_it_hides_behind():
    """Each chunk's exchange runs under another chunk's experts: the dispatch of chunk k is
    waited for after chunk k - 1's experts were issued, its combine after chunk k + 1's, and in
    the backward the reverse exchanges likewise. One chunk, the exchange without the flag,
    hides nothing: every wait follows its issue with no computation between."""
    (log,) = {tuple(log) for log in run_distributed(_chunk_schedule, 2, 2)}
    log = list(log)

    def after(wait: str, work: str) -> bool:
        return log.index(f"issue {wait}") < log.index(work) < log.index(f"wait {wait}")

    assert after("dispatch 1", "experts 0 forward"), log
    assert after("combine 0", "experts 1 forward"), log
    assert after("reverse combine 0", "experts 1 backward"), log
    assert after("reverse dispatch 1", "experts 0 backward"), log
    assert sorted(_hidden(log)) == sorted(
        ["dispatch 1", "dispatch weights 1", "combine 0", "reverse combine 0",
         "reverse dispatch 1", "reverse dispatch weights 1"]
    ), log  # fmt: skip
    (single,) = {tuple(log) for log in run_distributed(_chunk_schedule, 2, 1)}
    assert _hidden(list(single)) == [], single


def _chunked_at_two_sizes(rank: int, world_size: int, chunks: int):
    counts, _, _, block = _rank_inputs(rank, world_size)
    counts += 4  # 12 to 24 rows per destination: more than half of the smaller block's 32
    rows = torch.randn(int(counts.sum()), HIDDEN, dtype=torch.float64)
    row_weights = torch.rand(int(counts.sum()), dtype=torch.float64)
    results = []
    for capacity in (32, 64):
        x = rows.clone().requires_grad_()
        scale = row_weights.clone().requires_grad_()
        weights = block.clone().requires_grad_()
        exchange = fixed_blocks.FixedBlockExchange.plan(counts, x.shape[0], capacity, None, chunks)
        run = _experts_runner(weights, [])
        out = fixed_blocks.run_experts_in_blocks(x, scale, exchange, run)
        out.backward(torch.ones_like(out))
        results.append((out.detach(), x.grad, scale.grad, weights.grad))
    return [torch.equal(a, b) for a, b in zip(*results)]


@pytest.mark.parametrize("chunks", [1, 2])
def test_blocks_of_any_size_give_the_same_numbers(chunks):
    """The padding takes part in no computation, and a grown or shrunk factor (a resumed run
    starts from the flag's) cuts the rows into the same chunks: blocks of 32 and 64 rows give
    the same outputs and gradients bit for bit."""
    for equal in run_distributed(_chunked_at_two_sizes, 2, chunks):
        assert all(equal), equal
