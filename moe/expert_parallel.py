"""Expert parallelism for the dropless MoE: experts sharded over ranks, tokens moved by all-to-all.

With an expert-parallel (EP) group of P ranks and E experts, rank r holds the contiguous block of
experts [r * E/P, (r + 1) * E/P) (`Experts` draws the full [E, ...] weights and keeps its slice,
so any P reproduces the P = 1 numbers). A dMoE layer's forward on rank r then runs:

1. route its own tokens over all E experts, sort the assignments by expert and gather the rows in
   that order (moe.kernels.token_rows); rows sorted by global expert are also sorted by
   destination rank;
2. `ExpertExchange.plan`: one all_to_all_single of the [P, E/P] count matrix tells every rank
   how many rows each source sends to each of its local experts; the split sizes then come to the
   host (`.tolist()`), the layer's one device-to-host sync: all_to_all_single takes its splits as
   Python ints, as in Megatron-core and MegaBlocks;
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

Expert parameters are marked as megatron.expert_parameters describes, which also says how their
gradients are reduced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from moe.config import MoEConfig


def check_expert_parallel_size(config: MoEConfig, size: int) -> None:
    """Raise unless `config` was built for an expert-parallel group of `size` ranks: a layer
    placed on a group of another size would hold the wrong experts."""
    if size != config.expert_model_parallel_size:
        raise RuntimeError(
            f"MoEConfig.expert_model_parallel_size is {config.expert_model_parallel_size} but "
            f"megatron.parallel_state's expert-parallel group has {size} rank(s); call "
            f"parallel_state.initialize_model_parallel(expert_model_parallel_size="
            f"{config.expert_model_parallel_size}) before placing the experts"
        )


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
        received, send_splits, receive_splits = exchange_counts(tokens_per_expert, group)
        local_indices = _expert_major_order(received, sum(receive_splits))
        tokens_per_local_expert = received.sum(0).int()
        return cls(group, send_splits, receive_splits, tokens_per_local_expert, local_indices)

    def dispatch(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows sorted by global expert [sum(send_splits), h] -> the rows for this rank's
        experts, source-major [sum(receive_splits), h]."""
        return all_to_all(rows, self.receive_splits, self.send_splits, self.group)

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        """Inverse of `dispatch`: expert outputs, source-major, back to the ranks they came
        from, in the order those ranks sent them."""
        return all_to_all(rows, self.send_splits, self.receive_splits, self.group)


@torch.no_grad()
def exchange_counts(
    tokens_per_expert: torch.Tensor, group: Optional[dist.ProcessGroup]
) -> Tuple[torch.Tensor, List[int], List[int]]:
    """(received [P, E/P], send_splits, receive_splits) for this rank's assignments per expert
    [E]: received[s, e] is what rank s sends to this rank's local expert e, and the splits are
    the rows sent to / received from each rank. Collective over `group`; one host sync."""
    world_size = dist.get_world_size(group)
    num_local = tokens_per_expert.numel() // world_size
    # sent[p, e]: rows for local expert e of rank p.
    sent = tokens_per_expert.to(torch.int64).reshape(world_size, num_local)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    # The layer's one device-to-host sync: all_to_all_single takes Python split sizes.
    splits = torch.cat([sent.sum(1), received.sum(1)]).tolist()
    return received, splits[:world_size], splits[world_size:]


def _expert_major_order(received: torch.Tensor, total_rows: int) -> torch.Tensor:
    """int32 [total_rows]: the source-major row (blocks (source s, expert e) in row-major
    order of `received` [P, E/P]) at each slot of the expert-major order (blocks (e, s))."""
    device = received.device
    source_starts = torch.cumsum(received.reshape(-1), 0) - received.reshape(-1)
    expert_major_counts = received.t().reshape(-1)
    expert_major_starts = torch.cumsum(expert_major_counts, 0) - expert_major_counts
    # output_size spares repeat_interleave its own host sync: the total is known already.
    block_of_slot = torch.repeat_interleave(
        torch.arange(expert_major_counts.numel(), device=device),
        expert_major_counts,
        output_size=total_rows,
    )
    rank_in_block = torch.arange(total_rows, device=device) - expert_major_starts[block_of_slot]
    source_start_of_block = source_starts.reshape(received.shape).t().reshape(-1)
    return (source_start_of_block[block_of_slot] + rank_in_block).int()
