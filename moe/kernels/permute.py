"""Rows in expert order into a padded buffer and back, for the block-sparse products.

The dMoE sorts its rows by expert with moe.kernels.token_rows; the block-sparse products want a
buffer with room between the experts. Every op here maps sorted slot i (assignment indices[i],
token indices[i] // top_k) to row = padded start of expert e + rank in e, each expert's rows
padded to a whole number of blocks (padded_gather / padded_scatter). (The capacity MoE's slots,
a buffer of the same kind, are plain-PyTorch gathers that torch.compile fuses:
moe.kernels.capacity_rows.)
One gather kernel writes each buffer row once (zeros where no assignment lands) and one scatter
kernel sums each token's top_k rows in fp32, so forward and backward of every op are these two
kernels: gather's backward is a scatter and scatter's backward is a weighted gather that also
computes the routing-weight gradient dot(y[row(a)], grad_out[token(a)]). The kernels are in
moe.kernels.permute_kernels; this module launches them, gives them their autograd, and holds the
plain-PyTorch references.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.kernels.dispatch import TRITON_AVAILABLE, use_triton
from moe.kernels.permute_kernels import BLOCK_H, INVERT_BLOCK

if TRITON_AVAILABLE:
    import triton

    from moe.kernels.permute_kernels import (
        _gather_kernel,
        _invert_permutation_kernel,
        _scatter_kernel,
    )

__all__ = [
    "padded_bins",
    "padded_gather",
    "padded_gather_reference",
    "padded_scatter",
    "padded_scatter_reference",
]


# Set by tests: fill kernel outputs with NaN before launch so unwritten elements show.
POISON_OUTPUTS = False


def _empty(*shape: int, like: torch.Tensor) -> torch.Tensor:
    out = torch.empty(*shape, dtype=like.dtype, device=like.device)
    return out.fill_(float("nan")) if POISON_OUTPUTS and out.is_floating_point() else out


def _block_e(num_experts: int) -> int:
    return max(triton.next_power_of_2(num_experts), 2)


def _gather_launch(src, indices, weights, other, bins, padded_bins, top_k, rows):
    """Runs _gather_kernel; returns (out [rows, H], grad_weights or None)."""
    src = src.contiguous()
    out = _empty(rows, src.shape[1], like=src)
    grad_weights = None
    if other is not None:
        grad_weights = torch.zeros(indices.numel(), dtype=weights.dtype, device=src.device)
    if rows == 0:
        return out, grad_weights
    _gather_kernel[(rows,)](
        src,
        out,
        indices,
        weights if weights is not None else src,
        other.contiguous() if other is not None else src,
        grad_weights if grad_weights is not None else src,
        bins,
        padded_bins,
        bins.numel(),
        src.shape[1],
        top_k,
        HAS_WEIGHTS=weights is not None,
        WEIGHT_GRAD=other is not None,
        BLOCK_E=_block_e(bins.numel()),
        BLOCK_H=min(BLOCK_H, triton.next_power_of_2(src.shape[1])),
    )
    return out, grad_weights


def _scatter_launch(src, indices, weights, bins, padded_bins, top_k, tokens):
    """Runs _scatter_kernel; returns out [tokens, H]."""
    src = src.contiguous()
    hidden = src.shape[-1]
    src = src.view(-1, hidden)
    out = _empty(tokens, hidden, like=src)
    num_assignments = indices.numel()
    if tokens == 0:
        return out
    positions = torch.empty_like(indices)
    if num_assignments > 0:
        grid = (triton.cdiv(num_assignments, INVERT_BLOCK),)
        _invert_permutation_kernel[grid](indices, positions, num_assignments, BLOCK=INVERT_BLOCK)
    block_h = min(BLOCK_H, triton.next_power_of_2(hidden))
    _scatter_kernel[(tokens, triton.cdiv(hidden, block_h))](
        src,
        out,
        positions,
        weights if weights is not None else src,
        bins,
        padded_bins,
        bins.numel(),
        hidden,
        top_k,
        HAS_WEIGHTS=weights is not None,
        BLOCK_E=_block_e(bins.numel()),
        BLOCK_H=block_h,
    )
    return out


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, indices, bins, padded_bins, top_k, rows):
        ctx.save_for_backward(indices, bins, padded_bins)
        ctx.args = (top_k, x.shape[0])
        return _gather_launch(x, indices, None, None, bins, padded_bins, top_k, rows)[0]

    @staticmethod
    def backward(ctx, grad_out):
        indices, bins, padded_bins = ctx.saved_tensors
        top_k, tokens = ctx.args
        grad_x = _scatter_launch(grad_out, indices, None, bins, padded_bins, top_k, tokens)
        return grad_x, None, None, None, None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, indices, weights, bins, padded_bins, top_k):
        ctx.save_for_backward(y, indices, weights, bins, padded_bins)
        ctx.args = (top_k, y.shape)
        tokens = indices.numel() // top_k
        return _scatter_launch(y, indices, weights, bins, padded_bins, top_k, tokens)

    @staticmethod
    def backward(ctx, grad_out):
        y, indices, weights, bins, padded_bins = ctx.saved_tensors
        top_k, y_shape = ctx.args
        weight_grad = weights is not None and ctx.needs_input_grad[2]
        rows = y.numel() // y.shape[-1]
        grad_y, grad_weights = _gather_launch(
            grad_out,
            indices,
            weights,
            y.reshape(rows, y.shape[-1]) if weight_grad else None,
            bins,
            padded_bins,
            top_k,
            rows,
        )
        return grad_y.view(y_shape), None, grad_weights, None, None, None


def _ints(*tensors: Optional[torch.Tensor]) -> list[Optional[torch.Tensor]]:
    return [None if tensor is None else tensor.contiguous().int() for tensor in tensors]


def _flat(weights: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    # Routers hand weights as [T, top_k]; the kernels read them as [T * top_k].
    return None if weights is None else weights.reshape(-1)


# --- references: the same functions with index_select / index_add in plain PyTorch -------------


def _rows_reference(bins, padded_bins):
    """Buffer row of every sorted slot, as in the kernels."""
    counts = torch.diff(bins.long(), prepend=bins.new_zeros(1).long())
    experts = torch.repeat_interleave(torch.arange(bins.numel(), device=bins.device), counts)
    rank = torch.arange(experts.numel(), device=bins.device) - (bins.long() - counts)[experts]
    padded = padded_bins.long()
    return torch.cat([padded.new_zeros(1), padded[:-1]])[experts] + rank


def _gather_reference(x, indices, bins, padded_bins, top_k, rows):
    slot_rows = _rows_reference(bins, padded_bins)
    tokens = indices.long() // top_k
    out = x.new_zeros(rows, x.shape[1])
    return out.index_copy(0, slot_rows, x.index_select(0, tokens))


def _scatter_reference(y, indices, weights, bins, padded_bins, top_k):
    hidden = y.shape[-1]
    slot_rows = _rows_reference(bins, padded_bins)
    assignments = indices.long()
    values = y.reshape(-1, hidden).index_select(0, slot_rows).float()
    if weights is not None:
        values = values * weights.reshape(-1).index_select(0, assignments).float()[:, None]
    out = torch.zeros(indices.numel() // top_k, hidden, dtype=torch.float32, device=y.device)
    return out.index_add(0, assignments // top_k, values).to(y.dtype)


# --- public ops ---------------------------------------------------------------------------------


def padded_bins(tokens_per_expert: torch.Tensor, block_size: int) -> torch.Tensor:
    """Inclusive ends after rounding each expert's count up to a multiple of block_size, int32 [E]."""
    if block_size <= 0:
        raise ValueError(f"padded_bins: block_size must be positive, got {block_size}")
    padded = (tokens_per_expert.long() + block_size - 1) // block_size * block_size
    return torch.cumsum(padded, 0).int()


def padded_gather_reference(x, indices, bins, padded_bins, top_k: int) -> torch.Tensor:
    """Plain-PyTorch padded_gather."""
    rows = int(padded_bins[-1]) if padded_bins.numel() else 0
    return _gather_reference(x, indices, bins, padded_bins, top_k, rows)


def padded_gather(x: torch.Tensor, indices, bins, padded_bins, top_k: int) -> torch.Tensor:
    """Expert-ordered rows with each expert starting at padded_bins[e - 1]; padding rows are zero."""
    if not use_triton(x):
        return padded_gather_reference(x, indices, bins, padded_bins, top_k)
    indices, bins, padded_bins = _ints(indices, bins, padded_bins)
    rows = int(padded_bins[-1]) if padded_bins.numel() else 0
    return _Gather.apply(x, indices, bins, padded_bins, top_k, rows)


def padded_scatter_reference(y_padded, indices, weights, bins, padded_bins, top_k: int):
    """Plain-PyTorch padded_scatter."""
    return _scatter_reference(y_padded, indices, weights, bins, padded_bins, top_k)


def padded_scatter(
    y_padded: torch.Tensor, indices, weights: Optional[torch.Tensor], bins, padded_bins, top_k: int
) -> torch.Tensor:
    """Inverse of padded_gather with top-k weights; padding rows are ignored. -> [T, H]."""
    if not use_triton(y_padded):
        return padded_scatter_reference(y_padded, indices, weights, bins, padded_bins, top_k)
    indices, bins, padded_bins = _ints(indices, bins, padded_bins)
    return _Scatter.apply(y_padded, indices, _flat(weights), bins, padded_bins, top_k)
