"""The exact expert-parallel exchange: exactly the rows each rank needs, its all-to-alls
overlapped with computation on the rank's own rows, forward and backward.

A layer's forward on rank r: route its own tokens over all E experts, sort the assignments by
expert and gather the rows in that order (moe.kernels.token_rows); `ExactExchange.plan` runs the
count exchange (moe.exchange.primitives.exchange_counts: one all-gather, then the [P, P] rows
between ranks come to the host, the layer's one device-to-host sync: all_to_all_single takes its
splits as Python ints, as in Megatron-core and MegaBlocks); the rows go to their experts' ranks
with variable splits, run there, and come back.

Of the rows a rank sends, the block for its own experts never needs the network.
`run_experts_exactly` splits that block in two halves and orders the work so that each
all-to-all has half of it to hide behind:

    forward:  start dispatch(remote rows) | own half 1 | wait | remote rows' experts
              start combine(remote outputs) | own half 2 | wait
    backward: start combine's reverse | own half 2 backward | wait | remote rows' backward
              start dispatch's reverse | own half 1 backward | wait

Each all-to-all runs asynchronously (`async_op=True`) between a start and a wait autograd node,
as moe.exchange.primitives' pair does for exchanges of equal totals; here the splits differ, so
the reverse exchange cannot travel as the wait node's gradient (its shape is the start node's
input's) and goes from one backward to the other in an `_InFlight` record. That is eager-only,
like the host sync this exchange needs anyway. With P ranks 1/P of the rows are a rank's own, so the share
of the exchange that can hide shrinks as P grows.

The result is the plain exchange's (dispatch, experts, combine) up to the order in which the
expert weight gradients sum their rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from moe.exchange.primitives import (
    RunExperts,
    exchange_counts,
    expert_major_order,
    host_counts,
)


@dataclass
class _InFlight:
    """One all-to-all between its start and wait nodes, and its reverse in the backward."""

    work: Optional[dist.Work] = None
    backward_work: Optional[dist.Work] = None
    backward_result: Optional[torch.Tensor] = None
    # Inputs of an exchange in flight stay referenced until it completes.
    keep: Tuple[torch.Tensor, ...] = field(default_factory=tuple)


def _start(x, output_splits, input_splits, group):
    """Starts all_to_all_single of x; (output buffer, work handle, the contiguous input)."""
    x = x.contiguous()
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    work = dist.all_to_all_single(out, x, output_splits, input_splits, group=group, async_op=True)
    return out, work, x


class _StartAllToAll(torch.autograd.Function):
    """Starts the exchange; its output is valid only after `_WaitAllToAll`. Backward waits for
    the reverse exchange that `_WaitAllToAll.backward` started."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group, flight):
        out, flight.work, sent = _start(x, output_splits, input_splits, group)
        flight.keep = (sent,)
        ctx.flight = flight
        return out

    @staticmethod
    def backward(ctx, _grad_of_pending):
        flight = ctx.flight
        flight.backward_work.wait()
        grad = flight.backward_result
        flight.backward_work = flight.backward_result = None
        flight.keep = ()
        return grad, None, None, None, None


class _WaitAllToAll(torch.autograd.Function):
    """Waits for the exchange started by `_StartAllToAll`; backward starts the reverse one."""

    @staticmethod
    def forward(ctx, pending, output_splits, input_splits, group, flight):
        flight.work.wait()
        flight.work, flight.keep = None, ()
        ctx.flight, ctx.splits, ctx.group = flight, (output_splits, input_splits), group
        return pending.view_as(pending)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        flight = ctx.flight
        flight.backward_result, flight.backward_work, sent = _start(
            grad, input_splits, output_splits, ctx.group
        )
        flight.keep = (sent,)
        # What _StartAllToAll.backward receives is ignored: it returns the reverse exchange.
        return grad, None, None, None, None


@dataclass
class ExactExchange:
    """The plan of one layer's overlapped exchange, from this rank's counts (collective)."""

    group: Optional[dist.ProcessGroup]
    # Split sizes of the exchange of remote rows only (this rank's entry is 0 on both sides).
    remote_send_splits: List[int]
    remote_receive_splits: List[int]
    own_start: int  # first of the rows this rank sends to itself
    own_halves: Tuple[int, int]  # rows in the first and second half of that block
    own_counts: Tuple[torch.Tensor, torch.Tensor]  # per local expert, for each half
    remote_indices: torch.Tensor  # received remote rows -> local-expert-major order
    remote_counts: torch.Tensor  # received remote rows per local expert
    tokens_per_local_expert: torch.Tensor  # all rows per local expert, own ones included
    imbalance: float  # max over mean rows received per rank of the group (ExchangeCounts)

    @classmethod
    @torch.no_grad()
    def plan(
        cls, tokens_per_expert: torch.Tensor, group: Optional[dist.ProcessGroup]
    ) -> ExactExchange:
        """From this rank's assignments per expert [E] (all E experts): one all-gather of the
        counts, one host sync; the plan is worked out on the host and reaches the device in
        two small copies."""
        rank = dist.get_rank(group)
        device = tokens_per_expert.device
        counts = exchange_counts(tokens_per_expert, group)
        send_splits, receive_splits = counts.send_splits, counts.receive_splits
        remote_send, remote_receive = list(send_splits), list(receive_splits)
        remote_send[rank] = remote_receive[rank] = 0
        received = counts.received()
        remote = counts.received(exclude_own=True)
        own = received[rank]
        own_rows = send_splits[rank]
        half = own_rows // 2
        # Rows of each local expert that fall in the first half of the own block.
        first, end = [], 0
        for rows in own:
            first.append(min(end + rows, half) - min(end, half))
            end += rows
        second = [rows - f for rows, f in zip(own, first)]
        local = len(own)
        table = host_counts(
            first + second + [sum(c) for c in zip(*remote)] + [sum(c) for c in zip(*received)],
            device,
        ).split(local)
        return cls(
            group=group,
            remote_send_splits=remote_send,
            remote_receive_splits=remote_receive,
            own_start=sum(send_splits[:rank]),
            own_halves=(half, own_rows - half),
            own_counts=(table[0], table[1]),
            remote_indices=expert_major_order(remote, device),
            remote_counts=table[2],
            tokens_per_local_expert=table[3],
            imbalance=counts.imbalance,
        )


class _SplitOwnRows(torch.autograd.Function):
    """rows -> (the rows for other ranks, the two halves of the own block); backward writes the
    three gradients into one tensor (slicing would have autograd add three zero-filled
    full-size gradients)."""

    @staticmethod
    def forward(ctx, rows, own_start, own_halves):
        own_end = own_start + sum(own_halves)
        ctx.own_start = own_start
        remote = torch.cat([rows[:own_start], rows[own_end:]])
        first, second = rows[own_start:own_end].split(list(own_halves))
        return remote, first.contiguous(), second.contiguous()

    @staticmethod
    def backward(ctx, grad_remote, grad_first, grad_second):
        start = ctx.own_start
        grad = torch.cat([grad_remote[:start], grad_first, grad_second, grad_remote[start:]])
        return grad, None, None


class _JoinOwnRows(torch.autograd.Function):
    """The inverse of `_SplitOwnRows`: the other ranks' outputs with the own block's two halves
    put back at `own_start`; backward splits the gradient without zero-filled copies."""

    @staticmethod
    def forward(ctx, remote, first, second, own_start):
        ctx.own_start, ctx.halves = own_start, (first.shape[0], second.shape[0])
        return torch.cat([remote[:own_start], first, second, remote[own_start:]])

    @staticmethod
    def backward(ctx, grad):
        start = ctx.own_start
        end = start + sum(ctx.halves)
        grad_remote = torch.cat([grad[:start], grad[end:]])
        grad_first, grad_second = grad[start:end].split(list(ctx.halves))
        return grad_remote, grad_first, grad_second, None


def _exchange_start(x, output_splits, input_splits, group, flight) -> torch.Tensor:
    return _StartAllToAll.apply(x, output_splits, input_splits, group, flight)


def _exchange_wait(pending, output_splits, input_splits, group, flight) -> torch.Tensor:
    return _WaitAllToAll.apply(pending, output_splits, input_splits, group, flight)


def run_experts_exactly(
    rows: torch.Tensor, row_weights: torch.Tensor, exchange: ExactExchange, run: RunExperts
) -> torch.Tensor:
    """Rows sorted by global expert (this rank's sends, rank-major) and their router weights ->
    the experts' weighted outputs in the same order, the rows of other ranks' experts computed
    there (module docstring). The weights travel beside the rows, in an exchange of their own."""
    halves = exchange.own_halves
    remote_rows, own_first, own_second = _SplitOwnRows.apply(rows, exchange.own_start, halves)
    remote_weights, weights_first, weights_second = _SplitOwnRows.apply(
        row_weights, exchange.own_start, halves
    )
    group = exchange.group
    send, receive = exchange.remote_send_splits, exchange.remote_receive_splits

    dispatch, dispatch_weights = _InFlight(), _InFlight()
    pending = _exchange_start(remote_rows, receive, send, group, dispatch)
    pending_weights = _exchange_start(remote_weights, receive, send, group, dispatch_weights)
    out_first = run(own_first, weights_first, None, exchange.own_counts[0])
    received = _exchange_wait(pending, receive, send, group, dispatch)
    received_weights = _exchange_wait(pending_weights, receive, send, group, dispatch_weights)
    remote_out = run(received, received_weights, exchange.remote_indices, exchange.remote_counts)

    combine = _InFlight()
    pending = _exchange_start(remote_out, send, receive, group, combine)
    out_second = run(own_second, weights_second, None, exchange.own_counts[1])
    returned = _exchange_wait(pending, send, receive, group, combine)
    return _JoinOwnRows.apply(returned, out_first, out_second, exchange.own_start)
