"""The dMoE's sort and permutation in plain PyTorch ops that torch.compile traces whole.

The Triton ops in sort.py and permute.py are launched from Python one by one; a dMoE layer
needs about as many launches as a whole dense transformer layer, and the eager layer is bound by
that host work (BENCHMARKS.md: 3.0 ms to enqueue a 3.1 ms step). Under torch.compile those
launches break the graph. These functions compute the same results with static shapes and no
host synchronization (no data-dependent sizes, no `.item()`), so Dynamo captures the whole
layer; Inductor then generates the Triton kernels itself, fusing the permutations with the
casts, weighting and bias around them. Used by `DroplessMoE` while compiling.

Assignment a = t * top_k + j is token t's j-th choice; sorting assignments by expert gives
`order` (sorted slot -> assignment) and its inverse `slot_of` (assignment -> sorted slot).
"""

from __future__ import annotations

from typing import Tuple

import torch

from moe.kernels import token_rows


def sort_assignments(
    expert_indices: torch.Tensor, num_experts: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, slot_of, tokens_per_expert) for flat expert indices [T * top_k].

    order: int64, the stable sort by expert (ties keep token order, as sort_by_expert does);
    slot_of: int64, its inverse permutation; tokens_per_expert: int32 [num_experts].
    """
    flat = expert_indices.reshape(-1)
    _, order = torch.sort(flat, stable=True)
    positions = torch.arange(flat.numel(), device=flat.device)
    slot_of = torch.empty_like(order).scatter_(0, order, positions)
    # scatter_add rather than bincount: bincount's output size depends on the data.
    ones = torch.ones_like(flat, dtype=torch.int32)
    tokens_per_expert = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    tokens_per_expert = tokens_per_expert.scatter_add(0, flat.long(), ones)
    return order, slot_of, tokens_per_expert


class _GatherRows(torch.autograd.Function):
    """out[i] = x[order[i] // top_k]; backward sums each token's top_k rows, read through
    slot_of, in fp32 (a gather, where autograd's index_select backward would be an atomic
    scatter)."""

    @staticmethod
    def forward(ctx, x, order, slot_of, top_k: int):
        ctx.save_for_backward(slot_of)
        ctx.top_k = top_k
        return x.index_select(0, order // top_k)

    @staticmethod
    def backward(ctx, grad_out):
        (slot_of,) = ctx.saved_tensors
        top_k = ctx.top_k
        rows = grad_out.index_select(0, slot_of)
        if top_k == 1:
            return rows, None, None, None
        grad_x = rows.view(-1, top_k, rows.shape[-1]).float().sum(1).to(grad_out.dtype)
        return grad_x, None, None, None


class _CombineRows(torch.autograd.Function):
    """out[t] = sum_j weights[t, j] * y[slot_of[t * top_k + j]], accumulated in fp32.

    Backward: grad_y[i] = weights[a] * grad_out[a // top_k] with a = order[i], and
    grad_weights[a] = dot(y[slot_of[a]], grad_out[a // top_k]); both gathers.
    """

    @staticmethod
    def forward(ctx, y, weights, order, slot_of, top_k: int):
        ctx.save_for_backward(y, weights, order, slot_of)
        ctx.top_k = top_k
        hidden = y.shape[-1]
        rows = y.index_select(0, slot_of).view(-1, top_k, hidden).float()
        combined = (rows * weights.view(-1, top_k, 1).float()).sum(1)
        return combined.to(y.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        y, weights, order, slot_of = ctx.saved_tensors
        top_k = ctx.top_k
        flat_weights = weights.reshape(-1)
        grad_y = grad_weights = None
        if ctx.needs_input_grad[0]:
            token_of_slot = order // top_k
            slot_weights = flat_weights.index_select(0, order).float()
            grad_rows = grad_out.index_select(0, token_of_slot).float()
            grad_y = (grad_rows * slot_weights[:, None]).to(y.dtype)
        if ctx.needs_input_grad[1]:
            rows = y.index_select(0, slot_of).float()
            grad_per_assignment = grad_out.float().repeat_interleave(top_k, dim=0)
            grad_weights = (rows * grad_per_assignment).sum(-1).to(weights.dtype)
            grad_weights = grad_weights.view_as(weights)
        return grad_y, grad_weights, None, None, None


def gather_rows(
    x: torch.Tensor, order: torch.Tensor, slot_of: torch.Tensor, top_k: int
) -> torch.Tensor:
    """Token rows in expert order, [T * top_k, H]: out[i] = x[order[i] // top_k].

    With top_k > 1 the backward sums each token's rows, a reduction Inductor reads at a third
    of the memory bandwidth; moe.kernels.token_rows does both directions as custom ops.
    """
    if top_k > 1:
        return token_rows.gather_rows(x, order, slot_of, top_k)
    return _GatherRows.apply(x, order, slot_of, top_k)


def combine_rows(
    y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, slot_of: torch.Tensor, top_k: int
) -> torch.Tensor:
    """Inverse of gather_rows weighted by the router: [T * top_k, H], weights [T, top_k] -> [T, H].

    With top_k > 1 through moe.kernels.token_rows (see gather_rows); with top_k = 1 Inductor
    fuses the permutation into the kernels around it.
    """
    if top_k > 1:
        return token_rows.combine_rows(y, weights, order, slot_of, top_k)
    return _CombineRows.apply(y, weights, order, slot_of, top_k)


def grouped_projection(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """x [N, K] rows grouped by expert (group e ends at offsets[e]) times weight [E, K, N'].

    torch._grouped_mm with its own autograd, which Inductor knows; the weight is cast to the
    rows' dtype here because autocast does not cover _grouped_mm.
    """
    return torch._grouped_mm(x, weight.to(x.dtype), offs=offsets)
