"""The dMoE's expert-parallel exchange with fixed shapes and no host sync
(`--moe-expert-parallel-buffer-factor`), optionally in chunks whose all-to-alls run under the
other chunks' experts (`--moe-expert-parallel-chunked-overlap`).

moe.exchange.exact moves exactly the rows each rank needs, which takes split sizes on the host:
one device-to-host sync per layer and micro-batch, after which the host launches the rest of
the layer while the GPU waits (docs/benchmark-log.md, issue 38). Here every source rank sends
every destination a block of `capacity` rows (the rows for that destination first, padding after
them), so all-to-alls have equal, static splits; every rank's per-expert counts travel in one
all-gather and stay on the device, where the receiving rank works out the local-expert order of
the rows it got. torch.compile traces the exchange with the rest of the layer (on the
torch._grouped_mm backend the whole dMoE layer is one graph).

Padding costs wire time only. The padding rows come after all real rows in local-expert order
and are in no product's groups (`padding_in_groups` False): the permutations into and out of
that order (moe.kernels.token_rows.permute_rows), the scaled activation and the grouped products
neither read nor write them, forward or backward, and the send buffers are not filled. Only the
block-sparse backend, whose topology covers every row, counts them in the last local expert;
they are then zeros with a zero router weight and add exactly nothing.

Chunks. With `chunks` K > 1 each block travels in K slices of capacity / K rows, one per
chunk's all-to-all: the n real rows from one rank to another are cut into K runs at the
rows floor(k n / K), run k in slice k (which holds it: n <= capacity). The cut depends on the
rows alone, not on the block size, so every row meets the same others in its chunk's products
at any factor, and a run resumed with another factor computes the same numbers. All K
dispatches are issued first; then chunk k's experts run while chunks k + 1.. are still
arriving and chunks ..k - 1's outputs are on their way back (moe.exchange.primitives' start
and wait nodes, whose backward mirrors this). One count all-gather plans every chunk. The
first dispatch and the last combine stay exposed, so about 1 / K of the exchange does
(docs/moe.md has the cost model).

Rows beyond a block's capacity do not travel: the plan records on the device the largest block
any rank needed (`needed`), and a step whose layers needed more than their capacity runs again
with larger blocks (moe.training_hooks.MoETrainingHooks.rerun_step; the trainer replays the
step's micro-batches from its random state), so the layer stays dropless. Chunks cut the same
blocks, so they change nothing of that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional

from moe.exchange.primitives import RunExperts, group_name, start_all_to_all, wait_all_to_all
from moe.kernels import token_rows


def block_capacity(rows: int, world_size: int, capacity_factor: float, chunks: int = 1) -> int:
    """Rows per source-to-destination block: capacity_factor times the balanced share of this
    rank's `rows`, rounded up to a multiple of 8 per chunk (and at least that)."""
    share = math.ceil(capacity_factor * rows / world_size)
    multiple = 8 * chunks
    return max(multiple, -(-share // multiple) * multiple)


@dataclass
class ReceivedChunk:
    """How one chunk's received slots [P * capacity / K] reach local-expert order."""

    position: torch.Tensor  # int64 [P*c]: local-expert-major position of each received slot
    sorted_slot: torch.Tensor  # int64 [P*c]: the inverse permutation
    tokens_per_local_expert: torch.Tensor  # [E/P] real rows (the padding: see `padded_counts`)
    real_rows: torch.Tensor  # int32 [1]: the real rows, first in local-expert order

    def padded_counts(self) -> torch.Tensor:
        """The counts with the padding rows in the last local expert."""
        counts = self.tokens_per_local_expert.clone()
        counts[-1] += self.position.shape[0] - self.real_rows[0].to(counts.dtype)
        return counts


@dataclass
class FixedBlockExchange:
    """One layer's plan, all on the device: where each sent row goes and how each chunk's
    received slots reach local-expert order."""

    group: Optional[dist.ProcessGroup]
    world_size: int
    capacity: int
    send_slot: torch.Tensor  # [N] int64: slot in the chunk-major send buffer (P*C: dropped)
    chunks: List[ReceivedChunk]
    needed: torch.Tensor  # int64 scalar: the largest block any rank of the group needed
    imbalance: torch.Tensor  # float64 scalar: max over mean rows received per rank

    @property
    def chunk_rows(self) -> int:
        """Rows of one chunk's slice of a block."""
        return self.capacity // len(self.chunks)

    @classmethod
    @torch.no_grad()
    def plan(
        cls,
        tokens_per_expert: torch.Tensor,
        num_rows: int,
        capacity: int,
        group: Optional[dist.ProcessGroup],
        chunks: int = 1,
    ) -> FixedBlockExchange:
        """Collective over `group` (one all-gather of the counts); no host sync. `capacity`
        must be a multiple of `chunks`."""
        if capacity % chunks:
            raise ValueError(f"a block of {capacity} rows does not cut into {chunks} chunks")
        size = dist.get_world_size(group)
        device = tokens_per_expert.device
        sends = tokens_per_expert.to(torch.int64).reshape(size, -1)  # [destination, expert]
        local = sends.shape[1]
        send_totals = sends.sum(1)
        # Sender side: of the n rows for destination d, the j-th is in the run k with
        # floor(k n / K) <= j < floor((k + 1) n / K), and goes to slot d * c + j - floor(k n / K)
        # of chunk k (c = C / K) if that is below c.
        chunk_rows = capacity // chunks
        destination_start = torch.cumsum(send_totals, 0) - send_totals
        row_destination = torch.repeat_interleave(
            torch.arange(size, device=device), send_totals, output_size=num_rows
        )
        within = torch.arange(num_rows, device=device) - destination_start[row_destination]
        rows_for_destination = send_totals[row_destination]
        chunk = torch.zeros_like(within)
        for boundary in range(1, chunks):
            chunk += within >= boundary * rows_for_destination // chunks
        offset = within - chunk * rows_for_destination // chunks
        send_slot = torch.where(
            offset < chunk_rows,
            chunk * size * chunk_rows + row_destination * chunk_rows + offset,
            size * capacity,
        )
        # Every rank's counts (one all-gather, as the exact exchange): this rank's column of
        # them is what it receives, and the per-rank totals give the load imbalance.
        # all_gather_single is all_gather_tensor's name from torch 2.13 on.
        gather = getattr(functional, "all_gather_single", None) or functional.all_gather_tensor
        matrix = gather(sends.contiguous(), 0, group_name(group))
        matrix = matrix.reshape(size, size, local)  # [source, destination, expert]
        received = matrix[:, dist.get_rank(group)]  # [source, expert]
        rows_per_rank = matrix.sum((0, 2)).double()
        imbalance = rows_per_rank.max() / rows_per_rank.mean().clamp(min=1.0)
        needed = matrix.sum(2).max()
        ends = torch.cumsum(received, 1)
        from_source = ends[:, -1:]  # [P, 1]
        starts = [k * from_source // chunks for k in range(chunks + 1)]
        return cls(
            group=group,
            world_size=size,
            capacity=capacity,
            send_slot=send_slot,
            chunks=[
                _received_chunk(ends, starts[k], starts[k + 1], chunk_rows) for k in range(chunks)
            ],
            needed=needed,
            imbalance=imbalance,
        )

    def overflowed(self) -> torch.Tensor:
        """Bool scalar on the device: whether some block needed more rows than its capacity."""
        return self.needed > self.capacity


def _received_chunk(
    ends: torch.Tensor, first: torch.Tensor, end: torch.Tensor, rows: int
) -> ReceivedChunk:
    """The plan of one chunk's received slots: `rows` per source, holding that source's real
    rows [first, end) (per source, [P, 1]; those past `rows` did not fit), given the per-source
    cumulative counts `ends` [P, E/P] of the rows sent in local-expert order."""
    size, local = ends.shape
    device = ends.device
    # What arrived of each (source, expert) run in this slice.
    ends = torch.minimum(torch.maximum(ends, first), torch.minimum(end, first + rows)) - first
    arrived = ends - torch.nn.functional.pad(ends[:, :-1], (1, 0))
    slot = torch.arange(rows, device=device)
    expert_of = (slot[None, :, None] >= ends[:, None, :]).sum(-1)  # [P, c]; local: padding
    real = expert_of < local
    expert = expert_of.clamp(max=local - 1)
    per_expert = arrived.sum(0)
    expert_start = torch.cumsum(per_expert, 0) - per_expert
    from_earlier_sources = torch.cumsum(arrived, 0) - arrived  # [P, E/P]
    block_start = ends - arrived
    sources = torch.arange(size, device=device)[:, None].expand(size, rows)
    position = (
        expert_start[expert]
        + from_earlier_sources[sources, expert]
        + slot[None, :]
        - block_start[sources, expert]
    )
    total = per_expert.sum()
    padding_rank = torch.cumsum((~real).reshape(-1), 0) - 1
    position = torch.where(real.reshape(-1), position.reshape(-1), total + padding_rank)
    return ReceivedChunk(
        position=position,
        sorted_slot=token_rows.inverse_permutation(position),
        tokens_per_local_expert=per_expert,
        real_rows=total.to(torch.int32).reshape(1),
    )


def _scatter_to_slots(rows: torch.Tensor, send_slot: torch.Tensor, slots: int, fill: bool):
    """[slots, ...] with each row at its slot (slot `slots`: dropped). The other slots are zeros
    with `fill`, else left as allocated (padding no one reads)."""
    shape = (slots + 1,) + tuple(rows.shape[1:])
    buffer = rows.new_zeros(shape) if fill else rows.new_empty(shape)
    return buffer.index_copy_(0, send_slot, rows)[:slots]


def _gather_from_slots(blocks: torch.Tensor, send_slot: torch.Tensor) -> torch.Tensor:
    """Each row from its slot; a dropped row (its step runs again) reads zeros."""
    slots = blocks.shape[0]
    dropped = (send_slot >= slots).view((-1,) + (1,) * (blocks.dim() - 1))
    return blocks.index_select(0, send_slot.clamp(max=slots - 1)).masked_fill(dropped, 0)


class _ToBlocks(torch.autograd.Function):
    """Sorted rows -> the send buffer [P*C, ...] (chunk-major); backward gathers the rows'
    gradients from their slots, without the zero-filled buffer autograd's would allocate."""

    @staticmethod
    def forward(ctx, rows, send_slot, slots, fill):
        ctx.save_for_backward(send_slot)
        return _scatter_to_slots(rows, send_slot, slots, fill)

    @staticmethod
    def backward(ctx, grad):
        (send_slot,) = ctx.saved_tensors
        return _gather_from_slots(grad, send_slot), None, None, None


class _FromBlocks(torch.autograd.Function):
    """The inverse of `_ToBlocks`; backward scatters the gradients to the slots, filling the
    others with zeros only with `fill` (where the padding is computed, its gradient must be
    finite)."""

    @staticmethod
    def forward(ctx, blocks, send_slot, fill):
        ctx.save_for_backward(send_slot)
        ctx.slots, ctx.fill = blocks.shape[0], fill
        return _gather_from_slots(blocks, send_slot)

    @staticmethod
    def backward(ctx, grad):
        (send_slot,) = ctx.saved_tensors
        return _scatter_to_slots(grad, send_slot, ctx.slots, ctx.fill), None, None


def run_experts_in_blocks(
    rows: torch.Tensor,
    row_weights: torch.Tensor,
    exchange: FixedBlockExchange,
    run: RunExperts,
    padding_in_groups: bool = False,
) -> torch.Tensor:
    """moe.exchange.exact.run_experts_exactly's contract with fixed-size blocks.

    `padding_in_groups`: count the padding rows (after all real ones in local-expert order) in
    the last expert's group, which then computes them as zeros, for a `run` that computes every
    row (the block-sparse backend); False leaves them out of every group and every pass."""
    group, size, chunk_rows = exchange.group, exchange.world_size, exchange.chunk_rows
    splits = [chunk_rows] * size
    slots, fill = size * exchange.capacity, padding_in_groups
    buffer = _ToBlocks.apply(rows, exchange.send_slot, slots, fill)
    weights = _ToBlocks.apply(row_weights, exchange.send_slot, slots, fill)
    if len(exchange.chunks) > 1:
        buffer, weights = buffer.split(size * chunk_rows), weights.split(size * chunk_rows)
    else:
        buffer, weights = [buffer], [weights]
    in_flight = [
        (start_all_to_all(piece, splits, splits, group), start_all_to_all(w, splits, splits, group))
        for piece, w in zip(buffer, weights)
    ]
    returning = []
    for (rows_in_flight, weights_in_flight), chunk in zip(in_flight, exchange.chunks):
        received = wait_all_to_all(rows_in_flight, splits, splits, group)
        received_weights = wait_all_to_all(weights_in_flight, splits, splits, group)
        slot, position = chunk.sorted_slot, chunk.position
        everything = torch.full_like(chunk.real_rows, slot.shape[0])
        counted = everything if padding_in_groups else chunk.real_rows
        sorted_rows = token_rows.permute_rows(received, slot, position, counted)
        sorted_weights = received_weights.index_select(0, slot)
        counts = chunk.padded_counts() if padding_in_groups else chunk.tokens_per_local_expert
        outputs = run(sorted_rows, sorted_weights, None, counts)
        back = token_rows.permute_rows(outputs, position, slot, counted, by_source=True)
        returning.append(start_all_to_all(back, splits, splits, group))
    returned = [wait_all_to_all(pending, splits, splits, group) for pending in returning]
    blocks = returned[0] if len(returned) == 1 else torch.cat(returned)
    return _FromBlocks.apply(blocks, exchange.send_slot, fill)
