"""Moving token rows into expert order and back: gather/scatter, padded and binned variants.

Every op maps sorted slot i (assignment indices[i], token indices[i] // top_k) to a row of an
expert-ordered buffer, in one of three layouts:
- dense:  row = i                                   (gather / scatter)
- padded: row = padded start of expert e + rank in e (padded_gather / padded_scatter)
- binned: row = e * capacity + rank in e, dropped when rank >= capacity (binned_*)
One gather kernel writes each buffer row once (zeros where no assignment lands) and one scatter
kernel sums each token's top_k rows in fp32, so forward and backward of every op are these two
kernels: gather's backward is a scatter and scatter's backward is a weighted gather that also
computes the routing-weight gradient dot(y[row(a)], grad_out[token(a)]).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from megatron.kernels.aot import AotSpec
from megatron.kernels.dispatch import use_triton
from moe.kernels.sort import (
    expert_bins,
    expert_histogram,
    expert_histogram_reference,
    padded_bins,
    sort_by_expert,
    sort_by_expert_reference,
)

# The whole permute API in one import; counting and sorting live in sort.py.
__all__ = [
    "binned_gather",
    "binned_gather_reference",
    "binned_scatter",
    "binned_scatter_reference",
    "expert_bins",
    "expert_histogram",
    "expert_histogram_reference",
    "gather",
    "gather_reference",
    "padded_bins",
    "padded_gather",
    "padded_gather_reference",
    "padded_scatter",
    "padded_scatter_reference",
    "scatter",
    "scatter_reference",
    "sort_by_expert",
    "sort_by_expert_reference",
]

DENSE, PADDED, BINNED = 0, 1, 2
BLOCK_H = 128
INVERT_BLOCK = 256


@triton.jit
def _expert_of(offset, ends_ptr, num_experts, BLOCK_E: tl.constexpr):
    """Index of the expert whose [start, end) range in `ends` (inclusive ends) holds offset."""
    experts = tl.arange(0, BLOCK_E)
    ends = tl.load(ends_ptr + experts, mask=experts < num_experts, other=2147483647)
    return tl.sum((ends <= offset).to(tl.int32), axis=0)


@triton.jit
def _start_of(expert, ends_ptr):
    return tl.load(ends_ptr + expert - 1, mask=expert > 0, other=0)


@triton.jit
def _gather_kernel(
    src_ptr,
    out_ptr,
    indices_ptr,
    weights_ptr,
    other_ptr,
    grad_weights_ptr,
    bins_ptr,
    padded_bins_ptr,
    capacity,
    num_experts,
    hidden,
    top_k,
    LAYOUT: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """out[row] = weight * src[token of row]; zero for rows no assignment lands on.

    With WEIGHT_GRAD, also grad_weights[a] = dot(src[token], other[row]) (scatter's backward).
    """
    row = tl.program_id(0)
    if LAYOUT == 0:
        position = row
        valid = row >= 0
    else:
        if LAYOUT == 1:
            expert = _expert_of(row, padded_bins_ptr, num_experts, BLOCK_E)
            rank = row - _start_of(expert, padded_bins_ptr)
        else:
            expert = row // capacity
            rank = row - expert * capacity
        start = _start_of(expert, bins_ptr)
        valid = rank < tl.load(bins_ptr + expert) - start
        position = start + rank
    assignment = tl.load(indices_ptr + position, mask=valid, other=0)
    token = (assignment // top_k).to(tl.int64)
    scale = 1.0
    if HAS_WEIGHTS:
        scale = tl.load(weights_ptr + assignment, mask=valid, other=0).to(tl.float32)
    dot = tl.zeros([BLOCK_H], dtype=tl.float32)
    # while, not range(): triton 3.6's interpreter cannot range() over a runtime int with numpy 2.4.
    h = 0
    while h < hidden:
        cols = h + tl.arange(0, BLOCK_H)
        mask = cols < hidden
        values = tl.load(src_ptr + token * hidden + cols, mask=mask & valid, other=0).to(tl.float32)
        out_values = (values * scale).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row.to(tl.int64) * hidden + cols, out_values, mask=mask)
        if WEIGHT_GRAD:
            other = tl.load(
                other_ptr + row.to(tl.int64) * hidden + cols, mask=mask & valid, other=0
            )
            dot += values * other.to(tl.float32)
        h += BLOCK_H
    if WEIGHT_GRAD:
        grad = tl.sum(dot, axis=0).to(grad_weights_ptr.dtype.element_ty)
        tl.store(grad_weights_ptr + assignment, grad, mask=valid)


@triton.jit
def _scatter_kernel(
    src_ptr,
    out_ptr,
    positions_ptr,
    weights_ptr,
    bins_ptr,
    padded_bins_ptr,
    capacity,
    num_experts,
    hidden,
    top_k,
    LAYOUT: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """out[token] = sum over its top_k assignments of weight * src[row], accumulated in fp32."""
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    choice = 0
    while choice < top_k:  # while, not range(): see _gather_kernel
        assignment = token * top_k + choice
        position = tl.load(positions_ptr + assignment)
        if LAYOUT == 0:
            row = position
            valid = position >= 0
        else:
            expert = _expert_of(position, bins_ptr, num_experts, BLOCK_E)
            rank = position - _start_of(expert, bins_ptr)
            if LAYOUT == 1:
                row = _start_of(expert, padded_bins_ptr) + rank
                valid = rank >= 0
            else:
                row = expert * capacity + rank
                valid = rank < capacity
        values = tl.load(src_ptr + row.to(tl.int64) * hidden + cols, mask=mask & valid, other=0)
        values = values.to(tl.float32)
        if HAS_WEIGHTS:
            values *= tl.load(weights_ptr + assignment).to(tl.float32)
        total += values
        choice += 1
    tl.store(
        out_ptr + token.to(tl.int64) * hidden + cols, total.to(out_ptr.dtype.element_ty), mask=mask
    )


@triton.jit
def _invert_permutation_kernel(indices_ptr, positions_ptr, num_assignments, BLOCK: tl.constexpr):
    """positions[indices[i]] = i: each assignment's slot in sorted order."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < num_assignments
    assignments = tl.load(indices_ptr + offsets, mask=mask, other=0)
    tl.store(positions_ptr + assignments, offsets, mask=mask)


# Set by tests: fill kernel outputs with NaN before launch so unwritten elements show.
POISON_OUTPUTS = False


def _empty(*shape: int, like: torch.Tensor) -> torch.Tensor:
    out = torch.empty(*shape, dtype=like.dtype, device=like.device)
    return out.fill_(float("nan")) if POISON_OUTPUTS and out.is_floating_point() else out


def _block_e(num_experts: int) -> int:
    return max(triton.next_power_of_2(num_experts), 2)


def _gather_launch(src, indices, weights, other, bins, padded_bins, capacity, top_k, layout, rows):
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
        padded_bins if padded_bins is not None else bins,
        max(capacity, 1),
        bins.numel(),
        src.shape[1],
        top_k,
        LAYOUT=layout,
        HAS_WEIGHTS=weights is not None,
        WEIGHT_GRAD=other is not None,
        BLOCK_E=_block_e(bins.numel()),
        BLOCK_H=min(BLOCK_H, triton.next_power_of_2(src.shape[1])),
    )
    return out, grad_weights


def _scatter_launch(src, indices, weights, bins, padded_bins, capacity, top_k, layout, tokens):
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
        padded_bins if padded_bins is not None else bins,
        max(capacity, 1),
        bins.numel(),
        hidden,
        top_k,
        LAYOUT=layout,
        HAS_WEIGHTS=weights is not None,
        BLOCK_E=_block_e(bins.numel()),
        BLOCK_H=block_h,
    )
    return out


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, indices, bins, padded_bins, capacity, top_k, layout, rows):
        ctx.save_for_backward(indices, bins, padded_bins)
        ctx.args = (capacity, top_k, layout, x.shape[0])
        return _gather_launch(
            x, indices, None, None, bins, padded_bins, capacity, top_k, layout, rows
        )[0]

    @staticmethod
    def backward(ctx, grad_out):
        indices, bins, padded_bins = ctx.saved_tensors
        capacity, top_k, layout, tokens = ctx.args
        grad_x = _scatter_launch(
            grad_out, indices, None, bins, padded_bins, capacity, top_k, layout, tokens
        )
        return grad_x, None, None, None, None, None, None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, indices, weights, bins, padded_bins, capacity, top_k, layout):
        ctx.save_for_backward(y, indices, weights, bins, padded_bins)
        ctx.args = (capacity, top_k, layout, y.shape)
        tokens = indices.numel() // top_k
        return _scatter_launch(
            y, indices, weights, bins, padded_bins, capacity, top_k, layout, tokens
        )

    @staticmethod
    def backward(ctx, grad_out):
        y, indices, weights, bins, padded_bins = ctx.saved_tensors
        capacity, top_k, layout, y_shape = ctx.args
        weight_grad = weights is not None and ctx.needs_input_grad[2]
        rows = y.numel() // y.shape[-1]
        grad_y, grad_weights = _gather_launch(
            grad_out,
            indices,
            weights,
            y.reshape(rows, y.shape[-1]) if weight_grad else None,
            bins,
            padded_bins,
            capacity,
            top_k,
            layout,
            rows,
        )
        return grad_y.view(y_shape), None, grad_weights, None, None, None, None, None


def _ints(*tensors: Optional[torch.Tensor]) -> list[Optional[torch.Tensor]]:
    return [None if tensor is None else tensor.contiguous().int() for tensor in tensors]


def _flat(weights: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    # Routers hand weights as [T, top_k]; the kernels read them as [T * top_k].
    return None if weights is None else weights.reshape(-1)


# --- references: the same functions with index_select / index_add in plain PyTorch -------------


def _rows_reference(bins, padded_bins, capacity, layout):
    """Buffer row of every sorted slot (-1 where binned drops it), as in the kernels."""
    counts = torch.diff(bins.long(), prepend=bins.new_zeros(1).long())
    experts = torch.repeat_interleave(torch.arange(bins.numel(), device=bins.device), counts)
    rank = torch.arange(experts.numel(), device=bins.device) - (bins.long() - counts)[experts]
    if layout == DENSE:
        return torch.arange(experts.numel(), device=bins.device)
    if layout == PADDED:
        padded = padded_bins.long()
        return torch.cat([padded.new_zeros(1), padded[:-1]])[experts] + rank
    return torch.where(rank < capacity, experts * capacity + rank, torch.full_like(rank, -1))


def _gather_reference(x, indices, bins, padded_bins, capacity, top_k, layout, rows):
    slot_rows = _rows_reference(bins, padded_bins, capacity, layout)
    kept = slot_rows >= 0
    tokens = indices.long()[kept] // top_k
    out = x.new_zeros(rows, x.shape[1])
    return out.index_copy(0, slot_rows[kept], x.index_select(0, tokens))


def _scatter_reference(y, indices, weights, bins, padded_bins, capacity, top_k, layout):
    hidden = y.shape[-1]
    slot_rows = _rows_reference(bins, padded_bins, capacity, layout)
    kept = slot_rows >= 0
    assignments = indices.long()[kept]
    values = y.reshape(-1, hidden).index_select(0, slot_rows[kept]).float()
    if weights is not None:
        values = values * weights.reshape(-1).index_select(0, assignments).float()[:, None]
    out = torch.zeros(indices.numel() // top_k, hidden, dtype=torch.float32, device=y.device)
    return out.index_add(0, assignments // top_k, values).to(y.dtype)


# --- public ops ---------------------------------------------------------------------------------


def gather_reference(x, indices, bins, top_k: int) -> torch.Tensor:
    """Plain-PyTorch gather: out[i] = x[indices[i] // top_k]."""
    return _gather_reference(x, indices, bins, None, 0, top_k, DENSE, indices.numel())


def gather(x: torch.Tensor, indices, bins, top_k: int) -> torch.Tensor:
    """Token rows in expert order, [T * top_k, H]: out[i] = x[indices[i] // top_k]."""
    if not use_triton(x):
        return gather_reference(x, indices, bins, top_k)
    indices, bins = _ints(indices, bins)
    return _Gather.apply(x, indices, bins, None, 0, top_k, DENSE, indices.numel())


def scatter_reference(y, indices, weights, bins, top_k: int) -> torch.Tensor:
    """Plain-PyTorch scatter: out[t] = sum_j weights[a] * y[slot of a], a = t * top_k + j."""
    return _scatter_reference(y, indices, weights, bins, None, 0, top_k, DENSE)


def scatter(
    y: torch.Tensor, indices, weights: Optional[torch.Tensor], bins, top_k: int
) -> torch.Tensor:
    """Inverse of gather with top-k weights (None = 1): [T * top_k, H] -> [T, H]."""
    if not use_triton(y):
        return scatter_reference(y, indices, weights, bins, top_k)
    indices, bins = _ints(indices, bins)
    return _Scatter.apply(y, indices, _flat(weights), bins, None, 0, top_k, DENSE)


def padded_gather_reference(x, indices, bins, padded_bins, top_k: int) -> torch.Tensor:
    """Plain-PyTorch padded_gather."""
    rows = int(padded_bins[-1]) if padded_bins.numel() else 0
    return _gather_reference(x, indices, bins, padded_bins, 0, top_k, PADDED, rows)


def padded_gather(x: torch.Tensor, indices, bins, padded_bins, top_k: int) -> torch.Tensor:
    """Expert-ordered rows with each expert starting at padded_bins[e - 1]; padding rows are zero."""
    if not use_triton(x):
        return padded_gather_reference(x, indices, bins, padded_bins, top_k)
    indices, bins, padded_bins = _ints(indices, bins, padded_bins)
    rows = int(padded_bins[-1]) if padded_bins.numel() else 0
    return _Gather.apply(x, indices, bins, padded_bins, 0, top_k, PADDED, rows)


def padded_scatter_reference(y_padded, indices, weights, bins, padded_bins, top_k: int):
    """Plain-PyTorch padded_scatter."""
    return _scatter_reference(y_padded, indices, weights, bins, padded_bins, 0, top_k, PADDED)


def padded_scatter(
    y_padded: torch.Tensor, indices, weights: Optional[torch.Tensor], bins, padded_bins, top_k: int
) -> torch.Tensor:
    """Inverse of padded_gather with top-k weights; padding rows are ignored. -> [T, H]."""
    if not use_triton(y_padded):
        return padded_scatter_reference(y_padded, indices, weights, bins, padded_bins, top_k)
    indices, bins, padded_bins = _ints(indices, bins, padded_bins)
    return _Scatter.apply(y_padded, indices, _flat(weights), bins, padded_bins, 0, top_k, PADDED)


def binned_gather_reference(x, indices, bins, expert_capacity: int, top_k: int) -> torch.Tensor:
    """Plain-PyTorch binned_gather."""
    rows = bins.numel() * expert_capacity
    out = _gather_reference(x, indices, bins, None, expert_capacity, top_k, BINNED, rows)
    return out.view(bins.numel(), expert_capacity, x.shape[1])


def binned_gather(x: torch.Tensor, indices, bins, expert_capacity: int, top_k: int) -> torch.Tensor:
    """[E, expert_capacity, H]: each expert's first expert_capacity rows; the rest are dropped."""
    if not use_triton(x):
        return binned_gather_reference(x, indices, bins, expert_capacity, top_k)
    indices, bins = _ints(indices, bins)
    rows = bins.numel() * expert_capacity
    out = _Gather.apply(x, indices, bins, None, expert_capacity, top_k, BINNED, rows)
    return out.view(bins.numel(), expert_capacity, x.shape[1])


def binned_scatter_reference(y, indices, weights, bins, top_k: int) -> torch.Tensor:
    """Plain-PyTorch binned_scatter."""
    return _scatter_reference(y, indices, weights, bins, None, y.shape[1], top_k, BINNED)


def binned_scatter(
    y: torch.Tensor, indices, weights: Optional[torch.Tensor], bins, top_k: int
) -> torch.Tensor:
    """Inverse of binned_gather with top-k weights; dropped assignments add 0. -> [T, H]."""
    if not use_triton(y):
        return binned_scatter_reference(y, indices, weights, bins, top_k)
    indices, bins = _ints(indices, bins)
    return _Scatter.apply(y, indices, _flat(weights), bins, None, y.shape[1], top_k, BINNED)


def _gather_spec(layout: int, dtype: str, has_weights: bool, weight_grad: bool) -> AotSpec:
    pointers = ["src_ptr", "out_ptr", "weights_ptr", "other_ptr", "grad_weights_ptr"]
    return AotSpec(
        kernel=_gather_kernel,
        signature={
            **{name: f"*{dtype}" for name in pointers},
            **{name: "*i32" for name in ("indices_ptr", "bins_ptr", "padded_bins_ptr")},
            **{name: "i32" for name in ("capacity", "num_experts", "hidden", "top_k")},
        },
        constexprs={
            "LAYOUT": layout,
            "HAS_WEIGHTS": has_weights,
            "WEIGHT_GRAD": weight_grad,
            "BLOCK_E": 64,
            "BLOCK_H": BLOCK_H,
        },
    )


def _scatter_spec(layout: int, dtype: str, has_weights: bool) -> AotSpec:
    return AotSpec(
        kernel=_scatter_kernel,
        signature={
            **{name: f"*{dtype}" for name in ("src_ptr", "out_ptr", "weights_ptr")},
            **{name: "*i32" for name in ("positions_ptr", "bins_ptr", "padded_bins_ptr")},
            **{name: "i32" for name in ("capacity", "num_experts", "hidden", "top_k")},
        },
        constexprs={
            "LAYOUT": layout,
            "HAS_WEIGHTS": has_weights,
            "BLOCK_E": 64,
            "BLOCK_H": BLOCK_H,
        },
    )


AOT_SPECS = (
    [_gather_spec(layout, "bf16", False, False) for layout in (DENSE, PADDED, BINNED)]
    + [_gather_spec(layout, "bf16", True, True) for layout in (DENSE, PADDED, BINNED)]
    + [_gather_spec(PADDED, "fp32", True, False)]
    + [_scatter_spec(layout, "bf16", True) for layout in (DENSE, PADDED, BINNED)]
    + [_scatter_spec(DENSE, "fp32", False)]
    + [
        AotSpec(
            kernel=_invert_permutation_kernel,
            signature={"indices_ptr": "*i32", "positions_ptr": "*i32", "num_assignments": "i32"},
            constexprs={"BLOCK": INVERT_BLOCK},
        )
    ]
)
