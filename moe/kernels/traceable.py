"""The dMoE's sort and permutation in plain PyTorch ops that torch.compile traces whole.

The Triton ops in sort.py and permute.py are launched from Python one by one; a dMoE layer needs
about as many launches as a whole dense transformer layer, and the eager layer is bound by that
host work: enqueueing a step takes about as long as the GPU runs it (docs/benchmark-log.md).
Under torch.compile those launches break the graph. These functions compute the same results
with static shapes and no host synchronization (no data-dependent sizes, no `.item()`), so
Dynamo captures the whole layer; Inductor then generates the Triton kernels itself, fusing the
permutations and the router's weighting into the kernels around them. Used by `DroplessMoE`
while compiling, where `runs_on` says so.

Assignment a = t * top_k + j is token t's j-th choice; sorting assignments by expert gives
`order` (sorted slot -> assignment) and its inverse `slot_of` (assignment -> sorted slot).
"""

from __future__ import annotations

from typing import Tuple

import torch

from moe.kernels import grouped_gemm, token_rows


def runs_on(device: torch.device) -> bool:
    """Whether a compiled dMoE takes this path on `device`: where torch._grouped_mm has its
    fast kernel, and on CPU (where it loops over experts; the tests) whenever torch has it.
    Elsewhere (torch before 2.8, AMD GPUs, NVIDIA before Hopper) the layer runs the Triton
    kernels of moe.kernels.grouped_gemm and permute, which break the graph."""
    if device.type == "cpu":
        return grouped_gemm.torch_has_grouped_mm()
    return grouped_gemm.torch_grouped_mm_is_fast_on(device)


def sort_assignments(
    expert_indices: torch.Tensor, num_experts: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, slot_of, tokens_per_expert) for flat expert indices [T * top_k].

    order: int64, the stable sort by expert (ties keep token order, as sort_by_expert does);
    slot_of: int64, its inverse permutation; tokens_per_expert: int32 [num_experts].
    """
    flat = expert_indices.reshape(-1)
    # 16-bit keys: the GPU's radix sort makes one pass per key byte, 8 for int64 indices.
    key_dtype = torch.int16 if num_experts <= torch.iinfo(torch.int16).max else flat.dtype
    sorted_experts, order = torch.sort(flat.to(key_dtype), stable=True)
    positions = torch.arange(flat.numel(), device=flat.device)
    slot_of = torch.empty_like(order).scatter_(0, order, positions)
    # Counts from where each expert's run starts in the sorted keys, rather than a scatter_add
    # (atomics on E counters) or bincount (whose output size depends on the data).
    experts = torch.arange(num_experts + 1, device=flat.device, dtype=key_dtype)
    starts = torch.searchsorted(sorted_experts, experts)
    tokens_per_expert = (starts[1:] - starts[:-1]).to(torch.int32)
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


def sum_rows(
    rows: torch.Tensor, order: torch.Tensor, slot_of: torch.Tensor, top_k: int
) -> torch.Tensor:
    """Inverse of gather_rows: [T * top_k, H] rows in expert order -> [T, H], each token's
    top_k rows summed in fp32 (the router's weights are applied before, see
    Experts.forward_sorted_rows). Its backward is gather_rows."""
    if top_k > 1:
        return token_rows.sum_rows(rows, order, slot_of, top_k)
    # With top_k = 1 a permutation, whose backward permutes back: gather_rows with the roles
    # of order and slot_of swapped (out[t] = rows[slot_of[t]], grad[i] = grad_out[order[i]]).
    return _GatherRows.apply(rows, slot_of, order, 1)


def grouped_projection(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """x [N, K] rows grouped by expert (group e ends at offsets[e]) times weight [E, K, N'].

    torch._grouped_mm with its own autograd, which Inductor knows; the weight is cast to the
    rows' dtype here because autocast does not cover _grouped_mm.
    """
    return torch._grouped_mm(x, weight.to(x.dtype), offs=offsets)
