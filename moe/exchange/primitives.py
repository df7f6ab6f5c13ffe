"""What every expert-parallel exchange is made of: all-to-alls, and the count exchange that plans
them.

With an expert-parallel (EP) group of P ranks and E experts, rank r holds the contiguous block of
experts [r * E/P, (r + 1) * E/P) (`Experts` draws the full [E, ...] weights and keeps its slice,
so any P reproduces the P = 1 numbers). Rows sorted by global expert are also sorted by
destination rank. The three exchanges built from these pieces (moe.exchange's package docstring)
differ in what travels: exactly the rows each rank needs (moe.exchange.exact), fixed-size blocks
of them (moe.exchange.fixed_blocks), or the capacity MoE's slots (moe.exchange.capacity_slots).

- `all_to_all`: a differentiable all_to_all_single that waits at once; backward sends the
  gradients back the same way, splits swapped.
- `start_all_to_all` / `wait_all_to_all`: an exchange whose send and receive totals are equal
  (fixed-size blocks) cut in two autograd nodes, so that the work issued between them runs
  while the exchange is in flight, forward and backward. The wait node's backward issues the
  reverse exchange, whose result has the in-flight buffer's shape and so travels to the start
  node as its gradient (no state on the side, which torch.compile could not trace); the start
  node's backward waits for it. Autograd runs the ready node created last in the forward first,
  so the backward of the work issued between the two nodes in the forward runs while the
  reverse exchange is in flight. Both are torch's functional collectives (`_c10d_functional`);
  on GPUs the exchange runs on the communicator's stream and the wait makes the compute stream
  wait for it, with gloo on CPUs it runs in gloo's thread.
- `exchange_counts`: one all-gather of every rank's [E] counts (as Megatron-core's dispatcher
  does) tells every rank how many rows each source sends to each expert (`ExchangeCounts`);
  `expert_major_order` reorders received rows (grouped by source, then expert) into
  local-expert-major order.

Routing statistics stay local, as in MegaBlocks: every rank scores all E experts for its own
tokens, and its load-balancing loss and `tokens_per_expert` count only its own tokens.
Expert parameters are marked as megatron.parallel.expert_parameters describes, which also says
how their gradients are reduced.
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


# run(rows, row_weights, order, tokens_per_local_expert) -> outputs in the rows' order, each
# scaled by its weight: the local experts, as every exchange calls them. `order` None: the rows
# are already in local-expert order; else the permutation that puts them there (sorted row i is
# rows[order[i]]). Rows past the groups' total are padding, which the experts leave alone.
RunExperts = Callable[
    [torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor], torch.Tensor
]


def group_name(group: Optional[dist.ProcessGroup]) -> str:
    """The name functional collectives know `group` by (None: the default group)."""
    return (group if group is not None else dist.group.WORLD).group_name


def _issue(x: torch.Tensor, output_splits: List[int], input_splits: List[int], name: str):
    return torch.ops._c10d_functional.all_to_all_single(
        x.contiguous(), output_splits, input_splits, name
    )


class _StartAllToAll(torch.autograd.Function):
    """Issues the exchange; its output is valid only after `_WaitAllToAll`. Backward waits for
    the reverse exchange that `_WaitAllToAll.backward` issued (its incoming gradient)."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, name):
        return _issue(x, output_splits, input_splits, name)

    @staticmethod
    def backward(ctx, reverse_in_flight):
        return torch.ops._c10d_functional.wait_tensor(reverse_in_flight), None, None, None


class _WaitAllToAll(torch.autograd.Function):
    """Waits for the exchange `_StartAllToAll` issued; backward issues the reverse one."""

    @staticmethod
    def forward(ctx, in_flight, output_splits, input_splits, name):
        ctx.splits, ctx.name = (output_splits, input_splits), name
        return torch.ops._c10d_functional.wait_tensor(in_flight).view_as(in_flight)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _issue(grad, input_splits, output_splits, ctx.name), None, None, None


def start_all_to_all(
    x: torch.Tensor,
    output_splits: List[int],
    input_splits: List[int],
    group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Issues all_to_all_single of x's rows; the result is in flight until `wait_all_to_all`
    with the same splits (module docstring: what runs while it is). The splits must have equal
    sums (ValueError otherwise)."""
    if sum(output_splits) != sum(input_splits):
        raise ValueError(
            f"start_all_to_all exchanges equal totals; got {sum(input_splits)} rows out and "
            f"{sum(output_splits)} in (moe.exchange.exact handles unequal ones)"
        )
    return _StartAllToAll.apply(x, output_splits, input_splits, group_name(group))


def wait_all_to_all(
    in_flight: torch.Tensor,
    output_splits: List[int],
    input_splits: List[int],
    group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """The rows of an exchange `start_all_to_all` issued, once they have arrived."""
    return _WaitAllToAll.apply(in_flight, output_splits, input_splits, group_name(group))


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
