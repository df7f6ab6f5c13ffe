"""Token rows into expert order and back for top-k > 1, as ops torch.compile keeps whole.

The compiled dMoE (moe.kernels.traceable) moves rows with index_select and sums each token's
top_k rows, and Inductor turns those into reductions over the top-k dimension that read the
gathered rows at a third of the memory bandwidth (BENCHMARKS.md: 0.80 and 0.63 ms per step for
131,072 rows of 2,048 channels, against ~0.22 ms for one pass over those bytes on an H100).
These ops do the same work in Triton kernels that read and write each row once, in tiles of
several rows by a run of channels:

- `gather_rows(x, order, slot_of, top_k)`: out[i] = x[order[i] // top_k]; backward sums each token's
  top_k rows through `slot_of` (the combine kernel without weights).
- `combine_rows(y, weights, order, slot_of, top_k)`: out[t] = sum_j weights[t, j] *
  y[slot_of[t * top_k + j]], in fp32; backward is one pass over the sorted rows that writes
  grad_y[i] = weights[a] * grad_out[t] and grad_weights[a] = dot(y[i], grad_out[t]) for
  a = order[i], t = a // top_k.

They are `torch.library` custom ops with their own autograd, so Dynamo records each as one node
instead of tracing into the kernels. Each runs its Triton kernel where `use_triton` says so
and its pure-PyTorch reference otherwise (CPU tensors, MOE_KERNELS=reference).
"""

# No `from __future__ import annotations`: torch.library.custom_op reads the ops' signatures from
# their annotations, and older torch (2.4) does not resolve string annotations.
from typing import Optional, Tuple

import torch

from moe.kernels.dispatch import TRITON_AVAILABLE, use_triton

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from moe.kernels.aot import AotSpec

# Rows per program and channels per step: 16 rows x 256 bf16 channels is 8 KiB in flight per
# program, enough to keep HBM busy with the few programs per SM these kernels get.
BLOCK_ROWS = 16
BLOCK_H = 256


# --- references ----------------------------------------------------------------------------


def gather_rows_reference(x: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    return x.index_select(0, order // top_k)


def combine_rows_reference(
    y: torch.Tensor, weights: Optional[torch.Tensor], slot_of: torch.Tensor, top_k: int
) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * y[slot_of[t * top_k + j]] (weights None: plain sum)."""
    rows = y.index_select(0, slot_of).view(-1, top_k, y.shape[-1]).float()
    if weights is not None:
        rows = rows * weights.reshape(-1, top_k, 1).float()
    return rows.sum(1).to(y.dtype)


def combine_rows_backward_reference(
    y: torch.Tensor,
    weights: torch.Tensor,
    order: torch.Tensor,
    grad_out: torch.Tensor,
    top_k: int,
    weight_grad: bool,
):
    """(grad_y, grad_weights or None) of combine_rows."""
    flat_weights = weights.reshape(-1)
    grad_rows = grad_out.index_select(0, order // top_k).float()
    grad_y = (grad_rows * flat_weights.index_select(0, order).float()[:, None]).to(y.dtype)
    grad_weights = None
    if weight_grad:
        per_slot = (y.float() * grad_rows).sum(-1).to(weights.dtype)
        grad_weights = torch.empty(weights.shape, dtype=weights.dtype, device=weights.device)
        grad_weights.view(-1).index_copy_(0, order, per_slot)
    return grad_y, grad_weights


# --- Triton kernels ------------------------------------------------------------------------

if TRITON_AVAILABLE:

    @triton.jit
    def _gather_rows_kernel(
        x_ptr,
        order_ptr,
        out_ptr,
        num_rows,
        hidden,
        top_k,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """out[i, cols] = x[order[i] // top_k, cols] for a tile of rows i and channels cols."""
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        row_mask = rows < num_rows
        mask = row_mask[:, None] & (cols[None, :] < hidden)
        tokens = (tl.load(order_ptr + rows, mask=row_mask, other=0) // top_k).to(tl.int64)
        values = tl.load(x_ptr + tokens[:, None] * hidden + cols[None, :], mask=mask)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * hidden + cols[None, :], values, mask=mask)

    @triton.jit
    def _combine_rows_kernel(
        y_ptr,
        weights_ptr,
        slot_of_ptr,
        out_ptr,
        num_tokens,
        hidden,
        TOP_K: tl.constexpr,
        HAS_WEIGHTS: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """out[t, cols] = sum_j w[t, j] * y[slot_of[t * TOP_K + j], cols], summed in fp32."""
        tokens = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        token_mask = tokens < num_tokens
        mask = token_mask[:, None] & (cols[None, :] < hidden)
        total = tl.zeros([BLOCK_ROWS, BLOCK_H], dtype=tl.float32)
        for choice in tl.static_range(TOP_K):
            assignments = tokens * TOP_K + choice
            slots = tl.load(slot_of_ptr + assignments, mask=token_mask, other=0).to(tl.int64)
            values = tl.load(y_ptr + slots[:, None] * hidden + cols[None, :], mask=mask, other=0)
            values = values.to(tl.float32)
            if HAS_WEIGHTS:
                scale = tl.load(weights_ptr + assignments, mask=token_mask, other=0)
                values *= scale.to(tl.float32)[:, None]
            total += values
        out_ptrs = out_ptr + tokens.to(tl.int64)[:, None] * hidden + cols[None, :]
        tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _combine_rows_backward_kernel(
        y_ptr,
        weights_ptr,
        order_ptr,
        grad_out_ptr,
        grad_y_ptr,
        grad_weights_ptr,
        num_rows,
        hidden,
        top_k,
        WEIGHT_GRAD: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """For sorted rows i with a = order[i], t = a // top_k: grad_y[i] = w[a] * grad_out[t]
        and (WEIGHT_GRAD) grad_weights[a] = dot(y[i], grad_out[t]), in one pass over the rows."""
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < num_rows
        assignments = tl.load(order_ptr + rows, mask=row_mask, other=0)
        tokens = (assignments // top_k).to(tl.int64)
        scale = tl.load(weights_ptr + assignments, mask=row_mask, other=0).to(tl.float32)
        rows = rows.to(tl.int64)
        dot = tl.zeros([BLOCK_ROWS, BLOCK_H], dtype=tl.float32)
        for start in range(0, hidden, BLOCK_H):
            cols = start + tl.arange(0, BLOCK_H)
            mask = row_mask[:, None] & (cols[None, :] < hidden)
            grads = tl.load(grad_out_ptr + tokens[:, None] * hidden + cols[None, :], mask=mask)
            grads = grads.to(tl.float32)
            grad_y = (grads * scale[:, None]).to(grad_y_ptr.dtype.element_ty)
            tl.store(grad_y_ptr + rows[:, None] * hidden + cols[None, :], grad_y, mask=mask)
            if WEIGHT_GRAD:
                values = tl.load(y_ptr + rows[:, None] * hidden + cols[None, :], mask=mask)
                dot += values.to(tl.float32) * grads
        if WEIGHT_GRAD:
            grad_weights = tl.sum(dot, axis=1).to(grad_weights_ptr.dtype.element_ty)
            tl.store(grad_weights_ptr + assignments, grad_weights, mask=row_mask)


def _block_h(hidden: int) -> int:
    return min(BLOCK_H, triton.next_power_of_2(max(hidden, 16)))


def _gather_rows_triton(x, order, top_k):
    x = x.contiguous()
    rows, hidden = order.shape[0], x.shape[1]
    out = torch.empty(rows, hidden, device=x.device, dtype=x.dtype)
    if out.numel() == 0:
        return out
    block_h = _block_h(hidden)
    grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(hidden, block_h))
    _gather_rows_kernel[grid](
        x, order, out, rows, hidden, top_k, BLOCK_ROWS=BLOCK_ROWS, BLOCK_H=block_h
    )
    return out


def _combine_rows_triton(y, weights, slot_of, top_k):
    y = y.contiguous()
    hidden = y.shape[1]
    tokens = slot_of.shape[0] // top_k
    out = torch.empty(tokens, hidden, device=y.device, dtype=y.dtype)
    if out.numel() == 0:
        return out
    block_h = _block_h(hidden)
    grid = (triton.cdiv(tokens, BLOCK_ROWS), triton.cdiv(hidden, block_h))
    _combine_rows_kernel[grid](
        y,
        weights.reshape(-1) if weights is not None else y,
        slot_of,
        out,
        tokens,
        hidden,
        TOP_K=top_k,
        HAS_WEIGHTS=weights is not None,
        BLOCK_ROWS=BLOCK_ROWS,
        BLOCK_H=block_h,
    )
    return out


def _combine_rows_backward_triton(y, weights, order, grad_out, top_k, weight_grad):
    y, grad_out = y.contiguous(), grad_out.contiguous()
    rows, hidden = y.shape
    flat_weights = weights.reshape(-1).contiguous()
    grad_y = torch.empty_like(y)
    grad_weights = None
    if weight_grad:
        grad_weights = torch.empty(weights.shape, dtype=weights.dtype, device=weights.device)
    if rows > 0:
        grid = (triton.cdiv(rows, BLOCK_ROWS),)
        _combine_rows_backward_kernel[grid](
            y,
            flat_weights,
            order,
            grad_out,
            grad_y,
            grad_weights if weight_grad else flat_weights,
            rows,
            hidden,
            top_k,
            WEIGHT_GRAD=weight_grad,
            BLOCK_ROWS=BLOCK_ROWS,
            BLOCK_H=_block_h(hidden),
        )
    return grad_y, grad_weights


# --- the ops -------------------------------------------------------------------------------


@torch.library.custom_op("moe::gather_rows", mutates_args=())
def _gather_rows_op(
    x: torch.Tensor, order: torch.Tensor, slot_of: torch.Tensor, top_k: int
) -> torch.Tensor:
    if use_triton(x, order):
        return _gather_rows_triton(x, order, top_k)
    return gather_rows_reference(x, order, top_k)


@_gather_rows_op.register_fake
def _(x, order, slot_of, top_k):
    return x.new_empty(order.shape[0], x.shape[1])


@torch.library.custom_op("moe::sum_token_rows", mutates_args=())
def _sum_token_rows_op(rows: torch.Tensor, slot_of: torch.Tensor, top_k: int) -> torch.Tensor:
    """out[t] = sum_j rows[slot_of[t * top_k + j]], in fp32: gather_rows' backward."""
    if use_triton(rows, slot_of):
        return _combine_rows_triton(rows, None, slot_of, top_k)
    return combine_rows_reference(rows, None, slot_of, top_k)


@_sum_token_rows_op.register_fake
def _(rows, slot_of, top_k):
    return rows.new_empty(slot_of.shape[0] // top_k, rows.shape[1])


@torch.library.custom_op("moe::combine_rows", mutates_args=())
def _combine_rows_op(
    y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, slot_of: torch.Tensor, top_k: int
) -> torch.Tensor:
    if use_triton(y, weights, slot_of):
        return _combine_rows_triton(y, weights, slot_of, top_k)
    return combine_rows_reference(y, weights, slot_of, top_k)


@_combine_rows_op.register_fake
def _(y, weights, order, slot_of, top_k):
    return y.new_empty(slot_of.shape[0] // top_k, y.shape[1])


@torch.library.custom_op("moe::combine_rows_backward", mutates_args=())
def _combine_rows_backward_op(
    y: torch.Tensor,
    weights: torch.Tensor,
    order: torch.Tensor,
    grad_out: torch.Tensor,
    top_k: int,
    weight_grad: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    if use_triton(y, weights, order, grad_out):
        grad_y, grad_weights = _combine_rows_backward_triton(
            y, weights, order, grad_out, top_k, weight_grad
        )
    else:
        grad_y, grad_weights = combine_rows_backward_reference(
            y, weights, order, grad_out, top_k, weight_grad
        )
    # A custom op returns tensors only: an empty one stands for "no weight gradient".
    return grad_y, grad_weights if grad_weights is not None else weights.new_empty(0)


@_combine_rows_backward_op.register_fake
def _(y, weights, order, grad_out, top_k, weight_grad):
    return torch.empty_like(y), torch.empty_like(weights) if weight_grad else weights.new_empty(0)


def _gather_setup(ctx, inputs, output):
    _, _, slot_of, top_k = inputs
    ctx.top_k = top_k
    ctx.save_for_backward(slot_of)


def _gather_backward(ctx, grad_out):
    (slot_of,) = ctx.saved_tensors
    return _sum_token_rows_op(grad_out, slot_of, ctx.top_k), None, None, None


def _combine_setup(ctx, inputs, output):
    y, weights, order, _, top_k = inputs
    ctx.top_k = top_k
    ctx.save_for_backward(y, weights, order)


def _combine_backward(ctx, grad_out):
    y, weights, order = ctx.saved_tensors
    weight_grad = ctx.needs_input_grad[1]
    grad_y, grad_weights = _combine_rows_backward_op(
        y, weights, order, grad_out.contiguous(), ctx.top_k, weight_grad
    )
    grad_y = grad_y if ctx.needs_input_grad[0] else None
    return grad_y, grad_weights if weight_grad else None, None, None, None


_gather_rows_op.register_autograd(_gather_backward, setup_context=_gather_setup)
_combine_rows_op.register_autograd(_combine_backward, setup_context=_combine_setup)


def gather_rows(
    x: torch.Tensor, order: torch.Tensor, slot_of: torch.Tensor, top_k: int
) -> torch.Tensor:
    """Token rows in expert order, [T * top_k, H]: out[i] = x[order[i] // top_k]."""
    return _gather_rows_op(x, order, slot_of, top_k)


def combine_rows(
    y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, slot_of: torch.Tensor, top_k: int
) -> torch.Tensor:
    """[T * top_k, H] rows in expert order -> [T, H]: out[t] = sum_j weights[t, j] * y[slot_of[t * top_k + j]]."""
    return _combine_rows_op(y, weights, order, slot_of, top_k)


def _spec(kernel, signature, constexprs):
    return AotSpec(kernel=kernel, signature=signature, constexprs=constexprs)


def _aot_specs(dtype: str) -> list:
    blocks = {"BLOCK_ROWS": BLOCK_ROWS, "BLOCK_H": BLOCK_H}
    return [
        _spec(
            _gather_rows_kernel,
            {"x_ptr": f"*{dtype}", "order_ptr": "*i64", "out_ptr": f"*{dtype}",
             "num_rows": "i32", "hidden": "i32", "top_k": "i32"},
            blocks,
        ),
        _spec(
            _combine_rows_kernel,
            {"y_ptr": f"*{dtype}", "weights_ptr": "*fp32", "slot_of_ptr": "*i64",
             "out_ptr": f"*{dtype}", "num_tokens": "i32", "hidden": "i32"},
            {"TOP_K": 8, "HAS_WEIGHTS": True, **blocks},
        ),
        _spec(
            _combine_rows_backward_kernel,
            {"y_ptr": f"*{dtype}", "weights_ptr": "*fp32", "order_ptr": "*i64",
             "grad_out_ptr": f"*{dtype}", "grad_y_ptr": f"*{dtype}",
             "grad_weights_ptr": "*fp32", "num_rows": "i32", "hidden": "i32", "top_k": "i32"},
            {"WEIGHT_GRAD": True, **blocks},
        ),
    ]  # fmt: skip


# What `python -m moe.kernels.aot` builds: each kernel for bf16 and fp32 rows.
AOT_SPECS = (
    [spec for dtype in ("bf16", "fp32") for spec in _aot_specs(dtype)] if TRITON_AVAILABLE else []
)
