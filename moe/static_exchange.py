"""The dMoE's expert-parallel exchange with fixed shapes and no host sync
(`--moe-expert-parallel-buffer-factor`).

moe.expert_parallel moves exactly the rows each rank needs, which takes split sizes on the host:
one device-to-host sync per layer and micro-batch, after which the host launches the rest of
the layer while the GPU waits (docs/benchmark-log.md, issue 38). Here every source rank sends
every destination a block of `capacity` rows (the rows for that destination first, zeros after
them), so both all-to-alls have equal, static splits; every rank's per-expert counts travel in
one all-gather and stay on the device, where the receiving rank works out the local-expert
order of the rows it got.

The collectives are functional collectives, so that torch.compile traces the exchange with the
rest of the layer (on the torch._grouped_mm backend the whole dMoE layer is one graph).

Rows beyond a block's capacity do not travel: the plan records on the device the largest block
any rank needed (`needed`), and a step whose layers needed more than their capacity runs again
with larger blocks (moe.training_hooks.MoETrainingHooks.rerun_step; the trainer replays the
step's micro-batches from its random state), so the layer stays dropless. Padding rows are
zeros with a zero router weight, after all real rows: torch._grouped_mm leaves them out of its
groups; for the other backends they are counted in the last local expert, where they contribute
exactly nothing (to the outputs and to every gradient).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional

from moe.expert_parallel import all_to_all
from moe.kernels import token_rows

RunExperts = Callable[
    [torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor], torch.Tensor
]


def _group(group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    return group if group is not None else dist.group.WORLD


def _equal_all_to_all(
    x: torch.Tensor, splits: List[int], group: Optional[dist.ProcessGroup]
) -> torch.Tensor:
    """Differentiable all-to-all of fixed splits, as a functional collective that torch.compile
    traces where the running torch has its autograd form; else moe.expert_parallel's."""
    traced = getattr(functional, "all_to_all_single_autograd", None)
    if traced is None:
        return all_to_all(x, splits, splits, group)
    return traced(x.contiguous(), splits, splits, _group(group))


def block_capacity(rows: int, world_size: int, capacity_factor: float) -> int:
    """Rows per source-to-destination block: capacity_factor times the balanced share of this
    rank's `rows`, rounded up to a multiple of 8 (and at least 8)."""
    share = math.ceil(capacity_factor * rows / world_size)
    return max(8, -(-share // 8) * 8)


@dataclass
class StaticExchange:
    """One layer's plan, all on the device: where each sent row goes and how the received
    blocks reach local-expert order."""

    group: Optional[dist.ProcessGroup]
    world_size: int
    capacity: int
    send_slot: torch.Tensor  # [N] int64: slot of each sorted row in the send buffer (P*C: dropped)
    received_position: torch.Tensor  # [P*C] int64: local-expert-major position of each slot
    sorted_slot: torch.Tensor  # [P*C] int64: the inverse permutation
    tokens_per_local_expert: torch.Tensor  # [E/P], the last one with the padding rows
    real_tokens_per_local_expert: torch.Tensor  # [E/P], without them
    needed: torch.Tensor  # int64 scalar: the largest block any rank of the group needed
    imbalance: torch.Tensor  # float64 scalar: max over mean rows received per rank

    @classmethod
    @torch.no_grad()
    def plan(
        cls,
        tokens_per_expert: torch.Tensor,
        num_rows: int,
        capacity: int,
        group: Optional[dist.ProcessGroup],
    ) -> StaticExchange:
        """Collective over `group` (one all-gather of the counts); no host sync."""
        size = dist.get_world_size(group)
        device = tokens_per_expert.device
        sends = tokens_per_expert.to(torch.int64).reshape(size, -1)  # [destination, expert]
        local = sends.shape[1]
        send_totals = sends.sum(1)
        # Sender side: the j-th row for destination d goes to slot d * C + j, if j < C.
        destination_start = torch.cumsum(send_totals, 0) - send_totals
        row_destination = torch.repeat_interleave(
            torch.arange(size, device=device), send_totals, output_size=num_rows
        )
        within = torch.arange(num_rows, device=device) - destination_start[row_destination]
        send_slot = torch.where(
            within < capacity, row_destination * capacity + within, size * capacity
        )
        # Every rank's counts (one all-gather, as the synced exchange): this rank's column of
        # them is what it receives, and the per-rank totals give the load imbalance.
        # all_gather_single is all_gather_tensor's name from torch 2.13 on.
        gather = getattr(functional, "all_gather_single", None) or functional.all_gather_tensor
        matrix = gather(sends.contiguous(), 0, _group(group))
        matrix = matrix.reshape(size, size, local)  # [source, destination, expert]
        received = matrix[:, dist.get_rank(group)]  # [source, expert]
        rows_per_rank = matrix.sum((0, 2)).double()
        imbalance = rows_per_rank.max() / rows_per_rank.mean().clamp(min=1.0)
        needed = matrix.sum(2).max()
        # Receiver side: what arrived of each (source, expert) block, capped at C per source.
        ends = torch.cumsum(received, 1).clamp(max=capacity)
        arrived = ends - torch.nn.functional.pad(ends[:, :-1], (1, 0))
        slot = torch.arange(capacity, device=device)
        expert_of = (slot[None, :, None] >= ends[:, None, :]).sum(-1)  # [P, C]; local: padding
        real = expert_of < local
        expert = expert_of.clamp(max=local - 1)
        per_expert = arrived.sum(0)
        expert_start = torch.cumsum(per_expert, 0) - per_expert
        from_earlier_sources = torch.cumsum(arrived, 0) - arrived  # [P, E/P]
        block_start = ends - arrived
        sources = torch.arange(size, device=device)[:, None].expand(size, capacity)
        position = (
            expert_start[expert]
            + from_earlier_sources[sources, expert]
            + slot[None, :]
            - block_start[sources, expert]
        )
        total = per_expert.sum()
        padding_rank = torch.cumsum((~real).reshape(-1), 0) - 1
        position = torch.where(real.reshape(-1), position.reshape(-1), total + padding_rank)
        tokens_per_local_expert = per_expert.clone()
        tokens_per_local_expert[-1] += size * capacity - total
        return cls(
            group=group,
            world_size=size,
            capacity=capacity,
            send_slot=send_slot,
            received_position=position,
            sorted_slot=token_rows.inverse_permutation(position),
            tokens_per_local_expert=tokens_per_local_expert,
            real_tokens_per_local_expert=per_expert,
            needed=needed,
            imbalance=imbalance,
        )

    def overflowed(self) -> torch.Tensor:
        """Bool scalar on the device: whether some block needed more rows than its capacity."""
        return self.needed > self.capacity


def _to_blocks(rows: torch.Tensor, exchange: StaticExchange) -> torch.Tensor:
    """Sorted rows -> the send buffer [P*C, ...]: each row at its slot, zeros elsewhere."""
    slots = exchange.world_size * exchange.capacity
    buffer = rows.new_zeros((slots + 1,) + tuple(rows.shape[1:]))
    return buffer.index_copy(0, exchange.send_slot, rows)[:slots]


def _from_blocks(blocks: torch.Tensor, exchange: StaticExchange) -> torch.Tensor:
    """The inverse of `_to_blocks`: each sorted row from its slot (a dropped row reads zeros)."""
    padded = torch.cat([blocks, blocks.new_zeros((1,) + tuple(blocks.shape[1:]))])
    return padded.index_select(0, exchange.send_slot)


def run_experts_static(
    rows: torch.Tensor,
    row_weights: torch.Tensor,
    exchange: StaticExchange,
    run: RunExperts,
    padding_in_groups: bool = True,
) -> torch.Tensor:
    """moe.overlapped_exchange.run_experts_overlapped's contract with fixed-size blocks.

    `padding_in_groups`: the padding rows (after all real ones in local-expert order) are
    counted in the last expert's group, which computes them as zeros; False leaves them out of
    every group, for a `run` that takes rows past its groups and leaves them alone (whatever it
    writes there is never read, and their gradients are never used)."""
    group, size, capacity = exchange.group, exchange.world_size, exchange.capacity
    splits = [capacity] * size
    received = _equal_all_to_all(_to_blocks(rows, exchange), splits, group)
    received_weights = _equal_all_to_all(_to_blocks(row_weights, exchange), splits, group)
    position, slot = exchange.received_position, exchange.sorted_slot
    sorted_rows = token_rows.gather_rows(received, slot, position, 1)
    sorted_weights = received_weights.index_select(0, slot)
    counts = (
        exchange.tokens_per_local_expert
        if padding_in_groups
        else exchange.real_tokens_per_local_expert
    )
    outputs = run(sorted_rows, sorted_weights, None, counts)
    returned = _equal_all_to_all(token_rows.sum_rows(outputs, slot, position, 1), splits, group)
    return _from_blocks(returned, exchange)
