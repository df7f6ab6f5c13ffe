"""Expert parallelism for the dropless MoE: experts sharded over ranks, tokens moved by all-to-all.

With an expert-parallel (EP) group of P ranks and E experts, rank r holds the contiguous block of
experts [r * E/P, (r + 1) * E/P) (`Experts` draws the full [E, ...] weights and keeps its slice,
so any P reproduces the P = 1 numbers). A dMoE layer's forward on rank r then runs:

1. route its own tokens over all E experts, sort the assignments by expert and gather the rows in
   that order (moe.kernels.token_rows); rows sorted by global expert are also sorted by
   destination rank;
2. `ExpertExchange.plan`: one all-gather of every rank's [E] counts tells every rank how many
   rows each source sends to each expert; the [P, P] rows between ranks then come to the host
   (`.tolist()`), the layer's one device-to-host sync: all_to_all_single takes its splits as
   Python ints, as in Megatron-core and MegaBlocks (the same copy gives the rows each rank
   receives, the expert-parallel load imbalance);
3. `dispatch`: all_to_all_single of the rows, and of their router weights, with those variable
   splits. The received rows are grouped by source rank, then expert; `local_indices` reorders
   them into local-expert-major order (expert, then source rank) by a permutation whose backward
   is the opposite permutation (a gather, no atomics);
4. the local experts run exactly as on one rank (grouped GEMM or block-sparse, each output row
   scaled by its weight), then the rows go back to source-major order and `combine` returns them
   with the reverse all-to-all; the origin rank sums each token's rows.
Backward of each all-to-all is the all-to-all of the gradients with the splits swapped.
`ExpertExchange` is this plain exchange; the dMoE layer runs the same exchange with its
all-to-alls overlapped with the rank's own rows (moe.overlapped_exchange), which tests check
against this one.

Routing statistics stay local, as in MegaBlocks: every rank scores all E experts for its own
tokens, and its load-balancing loss and `tokens_per_expert` count only its own tokens.

Expert parameters are marked as megatron.parallel.expert_parameters describes, which also says how their
gradients are reduced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist


def _all_to_all(
    x: torch.Tensor,
    output_splits: List[int],
    input_splits: List[int],
    group: Optional[dist.ProcessGroup],
) -> torch.Tensor:
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows to the ranks of `group` by `input_splits`, from them by `output_splits`; backward
    sends the gradients back the same way, splits swapped."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad_out):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad_out, input_splits, output_splits, ctx.group), None, None, None


def all_to_all(
    x: torch.Tensor,
    output_splits: List[int],
    input_splits: List[int],
    group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Differentiable all_to_all_single of the rows of x with variable split sizes."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


def run_slots_expert_parallel(
    slots: torch.Tensor,
    size: int,
    group: Optional[dist.ProcessGroup],
    forward_batched: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The capacity-limited MoE's experts split over `size` ranks: this rank's capacity slots
    of all E experts [E, C, h] go to the experts' ranks in one all-to-all of equal splits (rank
    p's experts are the p-th block of E / P), `forward_batched` runs the local experts on the
    slots of every rank, and the outputs come back the same way."""
    num_experts, capacity, hidden = slots.shape
    local = num_experts // size
    splits = [local * capacity] * size
    received = all_to_all(slots.reshape(-1, hidden), splits, splits, group)
    # [source, local expert, C, h] -> [local expert, source * C, h]
    by_expert = received.view(size, local, capacity, hidden).transpose(0, 1)
    outputs = forward_batched(by_expert.reshape(local, size * capacity, hidden))
    outputs = outputs.view(local, size, capacity, hidden).transpose(0, 1).reshape(-1, hidden)
    returned = all_to_all(outputs, splits, splits, group)
    return returned.view(num_experts, capacity, hidden)


@dataclass
class ExpertExchange:
    """How one layer's rows move through an expert-parallel group, planned from the counts.

    send_splits[p]: rows this rank sends to rank p; receive_splits[s]: rows it gets from rank s.
    The received rows (source-major) reach the local experts through a permutation:
    `local_indices[i]` is the received row at local-expert-major slot i, and
    `tokens_per_local_expert` [E/P] the rows of each local expert over all sources.
    """

    group: Optional[dist.ProcessGroup]
    send_splits: List[int]
    receive_splits: List[int]
    tokens_per_local_expert: torch.Tensor
    local_indices: torch.Tensor

    @classmethod
    @torch.no_grad()
    def plan(
        cls, tokens_per_expert: torch.Tensor, group: Optional[dist.ProcessGroup]
    ) -> ExpertExchange:
        """The exchange for this rank's assignments per expert, tokens_per_expert [E] (all E
        experts, E divisible by the group size). Collective over `group`; one host sync."""
        counts = exchange_counts(tokens_per_expert, group)
        device = tokens_per_expert.device
        received = counts.received()
        local_indices = expert_major_order(received, device)
        tokens_per_local_expert = host_counts([sum(c) for c in zip(*received)], device)
        return cls(
            group, counts.send_splits, counts.receive_splits, tokens_per_local_expert, local_indices
        )

    def dispatch(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows sorted by global expert [sum(send_splits), h] -> the rows for this rank's
        experts, source-major [sum(receive_splits), h]."""
        return all_to_all(rows, self.receive_splits, self.send_splits, self.group)

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        """Inverse of `dispatch`: expert outputs, source-major, back to the ranks they came
        from, in the order those ranks sent them."""
        return all_to_all(rows, self.send_splits, self.receive_splits, self.group)


@dataclass
class ExchangeCounts:
    """What one layer's count exchange tells this rank of its expert-parallel group, on the
    host: `sent[s][p][e]`, the rows rank s sends to local expert e of rank p (all ranks).

    Planned from host numbers, an exchange launches a handful of device operations after the
    layer's one sync instead of a chain of small ones: the layer's forward is paced by the host
    from that sync on.
    """

    rank: int
    sent: List[List[List[int]]]

    @property
    def world_size(self) -> int:
        return len(self.sent)

    def received(self, exclude_own: bool = False) -> List[List[int]]:
        """[source][local expert]: rows this rank's experts get from each source rank (none
        from itself with `exclude_own`)."""
        local = len(self.sent[0][0])
        return [
            [0] * local if exclude_own and source == self.rank else list(rows[self.rank])
            for source, rows in enumerate(self.sent)
        ]

    @property
    def send_splits(self) -> List[int]:
        """Rows this rank sends to each rank."""
        return [sum(experts) for experts in self.sent[self.rank]]

    @property
    def receive_splits(self) -> List[int]:
        """Rows this rank receives from each rank."""
        return [sum(rows[self.rank]) for rows in self.sent]

    @property
    def rows_received_per_rank(self) -> List[int]:
        """Rows every rank of the group receives."""
        return [sum(sum(rows[p]) for rows in self.sent) for p in range(self.world_size)]

    @property
    def imbalance(self) -> float:
        """Max over mean rows received per rank: 1.0 when every rank gets the same number (the
        layer's expert-parallel load imbalance: the busiest rank sets the pace)."""
        rows = self.rows_received_per_rank
        mean = sum(rows) / len(rows)
        return max(rows) / mean if mean > 0 else 1.0


@torch.no_grad()
def exchange_counts(
    tokens_per_expert: torch.Tensor, group: Optional[dist.ProcessGroup]
) -> ExchangeCounts:
    """The counts of this rank's assignments per expert [E], exchanged over `group`: one
    all-gather of every rank's counts (as Megatron-core's dispatcher does), so that each rank
    knows the whole (source, destination, local expert) matrix. Collective over `group`; the
    layer's one device-to-host sync (all_to_all_single takes Python split sizes)."""
    world_size = dist.get_world_size(group)
    num_local = tokens_per_expert.numel() // world_size
    counts = tokens_per_expert.to(torch.int64).contiguous()
    gathered = [torch.empty_like(counts) for _ in range(world_size)]
    dist.all_gather(gathered, counts, group=group)
    flat = torch.stack(gathered).tolist()
    sent = [[row[p * num_local : (p + 1) * num_local] for p in range(world_size)] for row in flat]
    return ExchangeCounts(rank=dist.get_rank(group), sent=sent)


def expert_major_order(received: List[List[int]], device: torch.device) -> torch.Tensor:
    """int32 [sum of received]: for rows received source-major (blocks (source s, local expert
    e), s-major, `received[s][e]` rows each), the received row at each slot of the
    local-expert-major order (blocks (e, s), e-major). Block offsets are computed on the host;
    the device expands them (one copy in, three kernels)."""
    sources, local = len(received), len(received[0])
    source_start, start = {}, 0
    for s in range(sources):
        for e in range(local):
            source_start[s, e] = start
            start += received[s][e]
    counts, offsets, slot = [], [], 0
    for e in range(local):
        for s in range(sources):
            counts.append(received[s][e])
            offsets.append(source_start[s, e] - slot)
            slot += received[s][e]
    table = torch.tensor([counts, offsets], dtype=torch.int64).to(device, non_blocking=True)
    block_offset = torch.repeat_interleave(table[1], table[0], output_size=slot)
    return (torch.arange(slot, device=device) + block_offset).int()


def host_counts(values: List[int], device: torch.device) -> torch.Tensor:
    """int32 device tensor of host counts."""
    return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)
