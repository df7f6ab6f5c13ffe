"""The dMoE's token rows into expert order and back, as ops torch.compile keeps whole.

Assignment a = t * top_k + j is token t's j-th choice. `sort_assignments` sorts the assignments
by expert: `order` (sorted slot -> assignment), its inverse `slot_of` (assignment -> sorted slot)
and the rows per expert, with static shapes and no host synchronization (no data-dependent
sizes, no `.item()`), so that Dynamo captures a whole dMoE layer. Then:

- `gather_rows(x, order, slot_of, top_k)`: out[i] = x[order[i] // top_k], written as
  out[slot_of[t * top_k + j]] = x[t];
- `sum_rows(rows, order, slot_of, top_k)`: out[t] = sum_j rows[slot_of[t * top_k + j]], in fp32.

Each is the other's backward. The router's weights are not applied here: the experts scale their
activations by them (moe.experts), where the scaling and its gradient fuse into the activation's
kernels. For top_k > 1 the two are Triton kernels that read and write each row once, in tiles
of several rows by a run of channels: Inductor's own reductions over the top-k dimension read
the gathered rows at a fraction of the memory bandwidth (docs/benchmark-log.md). They are
`torch.library` custom ops with their own autograd, so Dynamo records each as one node instead
of tracing into the kernels, and each runs its Triton kernel where `use_triton` says so and its
pure-PyTorch reference otherwise. For top_k = 1 they are permutations, index_select with its
inverse as backward, which Inductor fuses into the kernels around them.

`permute_rows(x, index, inverse, valid)` is the permutation of rows whose only real ones are
the first `valid` of the permuted order (a device scalar, never read on the host): the
expert-parallel fixed-size blocks put their padding rows last (moe.exchange.fixed_blocks), and
this op neither reads nor writes them, forward or backward, so padding costs no memory traffic.
"""

# No `from __future__ import annotations`: torch.library.custom_op reads the ops' signatures from
# their annotations, and older torch (2.4) does not resolve string annotations.

from typing import Tuple

import torch

from megatron.kernels.dispatch import TRITON_AVAILABLE, use_triton

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from megatron.kernels.aot import AotSpec

# Rows per program and channels per step: 16 rows x 256 bf16 channels is 8 KiB in flight per
# program, enough to keep HBM busy with the few programs per SM these kernels get.
BLOCK_ROWS = 16
BLOCK_H = 256


# --- references ----------------------------------------------------------------------------


def gather_rows_reference(x: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    return x.index_select(0, order // top_k)


def sum_rows_reference(rows: torch.Tensor, slot_of: torch.Tensor, top_k: int) -> torch.Tensor:
    """out[t] = sum_j rows[slot_of[t * top_k + j]], summed in fp32."""
    picked = rows.index_select(0, slot_of).view(-1, top_k, rows.shape[-1]).float()
    return picked.sum(1).to(rows.dtype)


def permute_rows_reference(
    x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, by_source: bool
) -> torch.Tensor:
    """out[i] = x[index[i]] where the row counts (`permute_rows_triton`); zeros elsewhere."""
    key = index if by_source else torch.arange(index.shape[0], device=index.device)
    real = (key < valid).unsqueeze(-1)
    return torch.where(real, x.index_select(0, index), torch.zeros((), dtype=x.dtype))


# --- Triton kernels ------------------------------------------------------------------------

if TRITON_AVAILABLE:

    @triton.jit
    def _gather_rows_kernel(
        x_ptr,
        slot_of_ptr,
        out_ptr,
        num_tokens,
        hidden,
        TOP_K: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """out[slot_of[t * TOP_K + j], cols] = x[t, cols] for a tile of tokens t and channels
        cols, every j: each token row is read once and written to its TOP_K slots (the mirror
        of _sum_rows_kernel). Walking the output rows instead reads each token row TOP_K
        times, from all over x, which was slower (docs/benchmark-log.md)."""
        tokens = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        token_mask = tokens < num_tokens
        mask = token_mask[:, None] & (cols[None, :] < hidden)
        x_ptrs = x_ptr + tokens.to(tl.int64)[:, None] * hidden + cols[None, :]
        values = tl.load(x_ptrs, mask=mask)
        for choice in tl.static_range(TOP_K):
            slots = tl.load(slot_of_ptr + tokens * TOP_K + choice, mask=token_mask, other=0)
            out_ptrs = out_ptr + slots.to(tl.int64)[:, None] * hidden + cols[None, :]
            tl.store(out_ptrs, values, mask=mask)

    @triton.jit
    def _sum_rows_kernel(
        rows_ptr,
        slot_of_ptr,
        out_ptr,
        num_tokens,
        hidden,
        TOP_K: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """out[t, cols] = sum_j rows[slot_of[t * TOP_K + j], cols], summed in fp32."""
        tokens = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        token_mask = tokens < num_tokens
        mask = token_mask[:, None] & (cols[None, :] < hidden)
        total = tl.zeros([BLOCK_ROWS, BLOCK_H], dtype=tl.float32)
        for choice in tl.static_range(TOP_K):
            slots = tl.load(slot_of_ptr + tokens * TOP_K + choice, mask=token_mask, other=0)
            slots = slots.to(tl.int64)
            values = tl.load(rows_ptr + slots[:, None] * hidden + cols[None, :], mask=mask, other=0)
            total += values.to(tl.float32)
        out_ptrs = out_ptr + tokens.to(tl.int64)[:, None] * hidden + cols[None, :]
        tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _permute_rows_kernel(
        x_ptr,
        index_ptr,
        valid_ptr,
        out_ptr,
        num_rows,
        hidden,
        BY_SOURCE: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """out[i, cols] = x[index[i], cols] for the rows i that count: i < valid, or with
        BY_SOURCE index[i] < valid. Other rows are neither read nor written."""
        valid = tl.load(valid_ptr)
        first = tl.program_id(0) * BLOCK_ROWS
        if not BY_SOURCE and first >= valid:
            return
        rows = first + tl.arange(0, BLOCK_ROWS)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        in_range = rows < num_rows
        index = tl.load(index_ptr + rows, mask=in_range, other=0)
        key = index if BY_SOURCE else rows
        counted = in_range & (key < valid)
        mask = counted[:, None] & (cols[None, :] < hidden)
        values = tl.load(x_ptr + index.to(tl.int64)[:, None] * hidden + cols[None, :], mask=mask)
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * hidden + cols[None, :]
        tl.store(out_ptrs, values, mask=mask)


def _block_h(hidden: int) -> int:
    return min(BLOCK_H, triton.next_power_of_2(max(hidden, 16)))


def _gather_rows_triton(x, slot_of, top_k):
    x = x.contiguous()
    tokens, hidden = x.shape
    out = torch.empty(slot_of.shape[0], hidden, device=x.device, dtype=x.dtype)
    if out.numel() == 0:
        return out
    block_h = _block_h(hidden)
    grid = (triton.cdiv(tokens, BLOCK_ROWS), triton.cdiv(hidden, block_h))
    _gather_rows_kernel[grid](
        x, slot_of, out, tokens, hidden, TOP_K=top_k, BLOCK_ROWS=BLOCK_ROWS, BLOCK_H=block_h
    )
    return out


def _sum_rows_triton(rows, slot_of, top_k):
    rows = rows.contiguous()
    hidden = rows.shape[1]
    tokens = slot_of.shape[0] // top_k
    out = torch.empty(tokens, hidden, device=rows.device, dtype=rows.dtype)
    if out.numel() == 0:
        return out
    block_h = _block_h(hidden)
    grid = (triton.cdiv(tokens, BLOCK_ROWS), triton.cdiv(hidden, block_h))
    _sum_rows_kernel[grid](
        rows, slot_of, out, tokens, hidden, TOP_K=top_k, BLOCK_ROWS=BLOCK_ROWS, BLOCK_H=block_h
    )
    return out


def permute_rows_triton(x, index, valid, by_source, out=None):
    """The kernel's launch; `out` (tests: one prefilled to show what is never written) defaults
    to an empty tensor."""
    x = x.contiguous()
    hidden = x.shape[1]
    if out is None:
        out = torch.empty(index.shape[0], hidden, device=x.device, dtype=x.dtype)
    if out.numel() == 0:
        return out
    block_h = _block_h(hidden)
    grid = (triton.cdiv(index.shape[0], BLOCK_ROWS), triton.cdiv(hidden, block_h))
    _permute_rows_kernel[grid](
        x, index, valid, out, index.shape[0], hidden, BY_SOURCE=by_source,
        BLOCK_ROWS=BLOCK_ROWS, BLOCK_H=block_h,
    )  # fmt: skip
    return out


# --- the ops -------------------------------------------------------------------------------


@torch.library.custom_op("moe::gather_rows", mutates_args=())
def _gather_rows_op(
    x: torch.Tensor, order: torch.Tensor, slot_of: torch.Tensor, top_k: int
) -> torch.Tensor:
    if use_triton(x, slot_of):
        return _gather_rows_triton(x, slot_of, top_k)
    return gather_rows_reference(x, order, top_k)


@_gather_rows_op.register_fake
def _(x, order, slot_of, top_k):
    return x.new_empty(order.shape[0], x.shape[1])


@torch.library.custom_op("moe::sum_rows", mutates_args=())
def _sum_rows_op(
    rows: torch.Tensor, order: torch.Tensor, slot_of: torch.Tensor, top_k: int
) -> torch.Tensor:
    if use_triton(rows, slot_of):
        return _sum_rows_triton(rows, slot_of, top_k)
    return sum_rows_reference(rows, slot_of, top_k)


@_sum_rows_op.register_fake
def _(rows, order, slot_of, top_k):
    return rows.new_empty(slot_of.shape[0] // top_k, rows.shape[1])


@torch.library.custom_op("moe::permute_rows", mutates_args=())
def _permute_rows_op(
    x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, valid: torch.Tensor,
    by_source: bool,
) -> torch.Tensor:  # fmt: skip
    if use_triton(x, index):
        return permute_rows_triton(x, index, valid, by_source)
    return permute_rows_reference(x, index, valid, by_source)


@_permute_rows_op.register_fake
def _(x, index, inverse, valid, by_source):
    return x.new_empty(index.shape[0], x.shape[1])


def _permute_rows_setup(ctx, inputs, output):
    _, index, inverse, valid, by_source = inputs
    ctx.by_source = by_source
    ctx.save_for_backward(index, inverse, valid)


def _permute_rows_backward(ctx, grad_out):
    # out[i] = x[index[i]] for counted i; so grad_x[j] = grad_out[inverse[j]], counted where
    # out's row inverse[j] was: the other side of the same test.
    index, inverse, valid = ctx.saved_tensors
    grad_x = _permute_rows_op(grad_out.contiguous(), inverse, index, valid, not ctx.by_source)
    return grad_x, None, None, None, None


_permute_rows_op.register_autograd(_permute_rows_backward, setup_context=_permute_rows_setup)


def _permutation_setup(ctx, inputs, output):
    _, order, slot_of, top_k = inputs
    ctx.top_k = top_k
    ctx.save_for_backward(order, slot_of)


def _gather_backward(ctx, grad_out):
    order, slot_of = ctx.saved_tensors
    grad_x = _sum_rows_op(grad_out.contiguous(), order, slot_of, ctx.top_k)
    return grad_x, None, None, None


def _sum_backward(ctx, grad_out):
    order, slot_of = ctx.saved_tensors
    grad_rows = _gather_rows_op(grad_out.contiguous(), order, slot_of, ctx.top_k)
    return grad_rows, None, None, None


_gather_rows_op.register_autograd(_gather_backward, setup_context=_permutation_setup)
_sum_rows_op.register_autograd(_sum_backward, setup_context=_permutation_setup)


class _Permute(torch.autograd.Function):
    """out[i] = x[order[i]] for a permutation `order` with inverse `inverse`; backward
    grad_x[j] = grad_out[inverse[j]] (a gather, where autograd's index_select backward would
    be an atomic scatter)."""

    @staticmethod
    def forward(ctx, x, order, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad_out):
        (inverse,) = ctx.saved_tensors
        return grad_out.index_select(0, inverse), None, None


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """int64 `inverse` with inverse[order[i]] = i, for a permutation `order` (int64)."""
    positions = torch.arange(order.numel(), device=order.device)
    return torch.empty_like(order).scatter_(0, order, positions)


def sort_assignments(
    expert_indices: torch.Tensor, num_experts: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, slot_of, tokens_per_expert) for expert indices [T, top_k] (or flat).

    order: int64, the stable sort by expert (ties keep token order); slot_of: int64, its
    inverse permutation; tokens_per_expert: int32 [num_experts].
    """
    flat = expert_indices.reshape(-1)
    # 16-bit keys: the GPU's radix sort makes one pass per key byte, 8 for int64 indices.
    key_dtype = torch.int16 if num_experts <= torch.iinfo(torch.int16).max else flat.dtype
    sorted_experts, order = torch.sort(flat.to(key_dtype), stable=True)
    slot_of = inverse_permutation(order)
    # Counts from where each expert's run starts in the sorted keys, rather than a scatter_add
    # (atomics on E counters) or bincount (whose output size depends on the data).
    experts = torch.arange(num_experts + 1, device=flat.device, dtype=key_dtype)
    starts = torch.searchsorted(sorted_experts, experts)
    tokens_per_expert = (starts[1:] - starts[:-1]).to(torch.int32)
    return order, slot_of, tokens_per_expert


def gather_rows(
    x: torch.Tensor, order: torch.Tensor, slot_of: torch.Tensor, top_k: int
) -> torch.Tensor:
    """Token rows in expert order, [T * top_k, H]: out[i] = x[order[i] // top_k]; the backward
    sums each token's top_k rows in fp32."""
    if top_k == 1:
        return _Permute.apply(x, order, slot_of)
    return _gather_rows_op(x, order, slot_of, top_k)


def sum_rows(
    rows: torch.Tensor, order: torch.Tensor, slot_of: torch.Tensor, top_k: int
) -> torch.Tensor:
    """Inverse of gather_rows: [T * top_k, H] rows in expert order -> [T, H], out[t] =
    sum_j rows[slot_of[t * top_k + j]] accumulated in fp32; its backward is gather_rows."""
    if top_k == 1:
        return _Permute.apply(rows, slot_of, order)
    return _sum_rows_op(rows, order, slot_of, top_k)


def permute_rows(
    x: torch.Tensor,
    index: torch.Tensor,
    inverse: torch.Tensor,
    valid: torch.Tensor,
    by_source: bool = False,
) -> torch.Tensor:
    """out[i] = x[index[i]] for a permutation `index` (int64, `inverse` its inverse), for the
    rows that count: the first `valid` of out (int64 [1] on x's device), or with `by_source`
    those read from the first `valid` of x. The others are left unwritten (their contents are
    unspecified), and the backward, the permutation by `inverse` under the mirrored test, writes
    no gradient for them either."""
    return _permute_rows_op(x, index, inverse, valid, by_source)


def _spec(kernel, signature, constexprs):
    return AotSpec(kernel=kernel, signature=signature, constexprs=constexprs)


def _aot_specs(dtype: str) -> list:
    blocks = {"BLOCK_ROWS": BLOCK_ROWS, "BLOCK_H": BLOCK_H}
    return [
        _spec(
            _gather_rows_kernel,
            {"x_ptr": f"*{dtype}", "slot_of_ptr": "*i64", "out_ptr": f"*{dtype}",
             "num_tokens": "i32", "hidden": "i32"},
            {"TOP_K": 8, **blocks},
        ),
        _spec(
            _sum_rows_kernel,
            {"rows_ptr": f"*{dtype}", "slot_of_ptr": "*i64", "out_ptr": f"*{dtype}",
             "num_tokens": "i32", "hidden": "i32"},
            {"TOP_K": 8, **blocks},
        ),
    ] + [
        _spec(
            _permute_rows_kernel,
            {"x_ptr": f"*{dtype}", "index_ptr": "*i64", "valid_ptr": "*i64",
             "out_ptr": f"*{dtype}", "num_rows": "i32", "hidden": "i32"},
            {"BY_SOURCE": by_source, **blocks},
        )
        for by_source in (False, True)
    ]  # fmt: skip


# What `python tools/compile_kernels.py` builds: each kernel for bf16 and fp32 rows.
AOT_SPECS = (
    [spec for dtype in ("bf16", "fp32") for spec in _aot_specs(dtype)] if TRITON_AVAILABLE else []
)
