"""The capacity MoE's token rows into its experts' capacity slots and back, as plain PyTorch ops
that torch.compile fuses with the work around them.

MegaBlocks' MoE gives each expert e the capacity C: slots [e * C, (e + 1) * C) of an [E * C, h]
buffer hold its first C assignments in assignment order (a = t * top_k + j, token t's j-th
choice); the rest are dropped and contribute nothing. Assignment a's rank among its expert's is
its place in the stable sort by expert (moe.kernels.token_rows.sort_assignments) less the
expert's start, so `capacity_slots` maps both ways with static shapes and no host sync:
- `slot_of_assignment` [T * k]: e * C + rank, or E * C (one past the slots) when dropped;
- `assignment_of_slot` [E * C]: the assignment a slot holds, or T * k when it is empty.
Megatron-Core's `probs` drop policy keeps each expert's C highest-weight assignments instead:
the same maps, from the sort by expert of the assignments in descending weight
(`sort_assignments_by_weight`).

Both directions are gathers, so every forward and backward below is one too (no atomics: the
same numbers on every run, no contention on the many empty slots and dropped assignments):
- `gather_into_slots(x, slots)`: [T, h] -> [E * C, h], zero rows in empty slots; its backward
  sums each token's k slot gradients in fp32 (a dropped assignment's is zero).
- `combine_from_slots(y, weights, slots)`: [E * C, h] -> [T, h], out[t] = sum_j w[t, j] *
  y[slot(t, j)] in fp32, MegaBlocks' weighted scatter; its backward gives y each slot's w *
  grad_out[t] and the weights dot(y[slot(a)], grad_out[t]).

The Triton gather and scatter kernels these replace (once moe.kernels.permute's binned layout)
were opaque to Dynamo, so a model with capacity MoE layers ran eagerly; written in PyTorch the
whole model compiles, and Inductor fuses these gathers, the experts' activation and the layers'
norms and residuals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

from moe.kernels.token_rows import inverse_permutation, sort_assignments


@dataclass(frozen=True)
class CapacitySlots:
    """Which slot each assignment takes and which assignment each slot holds (module
    docstring); sentinels one past the end mark dropped assignments and empty slots."""

    slot_of_assignment: torch.Tensor  # int64 [T * k]; E * C when dropped
    assignment_of_slot: torch.Tensor  # int64 [E * C]; T * k when empty
    top_k: int


@torch.no_grad()
def capacity_slots(
    expert_indices: torch.Tensor,
    order: torch.Tensor,
    slot_of: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    capacity: int,
) -> CapacitySlots:
    """The slots of capacity `capacity` per expert, from the stable sort of the assignments by
    expert: `order` (sorted position -> assignment), `slot_of` (its inverse) and the
    assignments per expert (moe.kernels.token_rows.sort_assignments)."""
    top_k = expert_indices.shape[-1]
    experts = expert_indices.reshape(-1).long()
    counts = tokens_per_expert.long()
    starts = torch.cumsum(counts, 0) - counts
    num_assignments, num_slots = experts.numel(), counts.numel() * capacity
    rank = slot_of.long() - starts[experts]
    slot_of_assignment = torch.where(rank < capacity, experts * capacity + rank, num_slots)
    slot = torch.arange(num_slots, device=experts.device)
    expert, rank_in_expert = slot // capacity, slot % capacity
    holds = rank_in_expert < counts[expert]
    sorted_position = (starts[expert] + rank_in_expert).clamp(max=num_assignments - 1)
    assignment_of_slot = torch.where(holds, order.long()[sorted_position], num_assignments)
    return CapacitySlots(slot_of_assignment, assignment_of_slot, top_k)


@torch.no_grad()
def sort_assignments_by_weight(
    expert_indices: torch.Tensor, expert_weights: torch.Tensor, num_experts: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sort_assignments`' (order, slot_of, tokens_per_expert) with each expert's assignments
    in descending router weight (equal weights in assignment order), for `capacity_slots` to
    keep the C highest-weight ones (Megatron-Core's `probs` drop policy)."""
    by_weight = torch.argsort(expert_weights.reshape(-1), descending=True, stable=True)
    order, _, tokens_per_expert = sort_assignments(
        expert_indices.reshape(-1)[by_weight], num_experts
    )
    order = by_weight[order]
    return order, inverse_permutation(order), tokens_per_expert


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index], with a zero row where index == len(x) (the sentinel)."""
    valid = (index < x.shape[0]).unsqueeze(-1)
    picked = x.index_select(0, index.clamp(max=x.shape[0] - 1))
    return torch.where(valid, picked, torch.zeros((), dtype=x.dtype, device=x.device))


def _sum_over_choices(rows: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T * k, h] -> [T, h]: each token's k rows summed in fp32 (MegaBlocks' rounding)."""
    if top_k == 1:
        return rows
    return rows.view(-1, top_k, rows.shape[-1]).float().sum(1).to(rows.dtype)


class _GatherIntoSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, slot_of_assignment, assignment_of_slot, top_k):
        ctx.save_for_backward(slot_of_assignment)
        ctx.top_k = top_k
        return _rows(x, torch.div(assignment_of_slot, top_k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad_slots):
        (slot_of_assignment,) = ctx.saved_tensors
        grad_x = _sum_over_choices(_rows(grad_slots, slot_of_assignment), ctx.top_k)
        return grad_x, None, None, None


class _CombineFromSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weights, slot_of_assignment, assignment_of_slot, top_k):
        ctx.save_for_backward(y, weights, slot_of_assignment, assignment_of_slot)
        ctx.top_k = top_k
        weighted = _rows(y, slot_of_assignment).float() * weights.float().unsqueeze(-1)
        return _sum_over_choices(weighted, top_k).to(y.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        y, weights, slot_of_assignment, assignment_of_slot = ctx.saved_tensors
        top_k = ctx.top_k
        # Each slot's token's gradient, scaled by the slot's weight (empty slots: zero).
        token_of_slot = torch.div(assignment_of_slot, top_k, rounding_mode="floor")
        slot_weights = _rows(weights.unsqueeze(-1), assignment_of_slot).float()
        grad_y = (_rows(grad_out, token_of_slot).float() * slot_weights).to(y.dtype)
        grad_weights = None
        if ctx.needs_input_grad[1]:
            per_assignment = grad_out.repeat_interleave(top_k, 0) if top_k > 1 else grad_out
            picked = _rows(y, slot_of_assignment).float()
            grad_weights = (picked * per_assignment.float()).sum(-1).to(weights.dtype)
        return grad_y, grad_weights, None, None, None


def gather_into_slots(x: torch.Tensor, slots: CapacitySlots) -> torch.Tensor:
    """Token rows x [T, h] into the slots [E * C, h]; zero rows where a slot is empty."""
    return _GatherIntoSlots.apply(
        x, slots.slot_of_assignment, slots.assignment_of_slot, slots.top_k
    )


def combine_from_slots(
    y: torch.Tensor, weights: torch.Tensor, slots: CapacitySlots
) -> torch.Tensor:
    """The experts' slot outputs y [E * C, h] back to tokens [T, h], each weighted by its
    assignment's router weight (`weights` [T * k]) and summed over the token's choices in fp32."""
    return _CombineFromSlots.apply(
        y, weights, slots.slot_of_assignment, slots.assignment_of_slot, slots.top_k
    )
