"""The permutations' Triton kernels and their AOT_SPECS; moe.kernels.permute launches them.

`_gather_kernel` writes each row of an expert-ordered buffer once (zeros where no assignment
lands), optionally with the routing-weight gradient; `_scatter_kernel` sums each token's top_k
rows in fp32; `_invert_permutation_kernel` gives each assignment's sorted slot. The buffer's
layout: each expert's rows padded to whole blocks (moe.kernels.permute).
"""

from __future__ import annotations

from megatron.kernels.dispatch import TRITON_AVAILABLE

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from megatron.kernels.aot import AotSpec

BLOCK_H = 128
INVERT_BLOCK = 256


if TRITON_AVAILABLE:

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
        num_experts,
        hidden,
        top_k,
        HAS_WEIGHTS: tl.constexpr,
        WEIGHT_GRAD: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """out[row] = weight * src[token of row]; zero for rows no assignment lands on.

        With WEIGHT_GRAD, also grad_weights[a] = dot(src[token], other[row]) (scatter's backward).
        """
        row = tl.program_id(0)
        expert = _expert_of(row, padded_bins_ptr, num_experts, BLOCK_E)
        rank = row - _start_of(expert, padded_bins_ptr)
        start = _start_of(expert, bins_ptr)
        valid = rank < tl.load(bins_ptr + expert) - start
        position = start + rank
        assignment = tl.load(indices_ptr + position, mask=valid, other=0)
        token = (assignment // top_k).to(tl.int64)
        scale = 1.0
        if HAS_WEIGHTS:
            scale = tl.load(weights_ptr + assignment, mask=valid, other=0).to(tl.float32)
        dot = tl.zeros([BLOCK_H], dtype=tl.float32)
        # while, not range(): triton 3.6's interpreter cannot range() over a runtime int with
        # numpy 2.4.
        h = 0
        while h < hidden:
            cols = h + tl.arange(0, BLOCK_H)
            mask = cols < hidden
            values = tl.load(src_ptr + token * hidden + cols, mask=mask & valid, other=0).to(
                tl.float32
            )
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
        num_experts,
        hidden,
        top_k,
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
            expert = _expert_of(position, bins_ptr, num_experts, BLOCK_E)
            rank = position - _start_of(expert, bins_ptr)
            row = _start_of(expert, padded_bins_ptr) + rank
            values = tl.load(src_ptr + row.to(tl.int64) * hidden + cols, mask=mask, other=0)
            values = values.to(tl.float32)
            if HAS_WEIGHTS:
                values *= tl.load(weights_ptr + assignment).to(tl.float32)
            total += values
            choice += 1
        tl.store(
            out_ptr + token.to(tl.int64) * hidden + cols,
            total.to(out_ptr.dtype.element_ty),
            mask=mask,
        )

    @triton.jit
    def _invert_permutation_kernel(
        indices_ptr, positions_ptr, num_assignments, BLOCK: tl.constexpr
    ):
        """positions[indices[i]] = i: each assignment's slot in sorted order."""
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < num_assignments
        assignments = tl.load(indices_ptr + offsets, mask=mask, other=0)
        tl.store(positions_ptr + assignments, offsets, mask=mask)


def _gather_spec(dtype: str, has_weights: bool, weight_grad: bool) -> AotSpec:
    pointers = ["src_ptr", "out_ptr", "weights_ptr", "other_ptr", "grad_weights_ptr"]
    return AotSpec(
        kernel=_gather_kernel,
        signature={
            **{name: f"*{dtype}" for name in pointers},
            **{name: "*i32" for name in ("indices_ptr", "bins_ptr", "padded_bins_ptr")},
            **{name: "i32" for name in ("num_experts", "hidden", "top_k")},
        },
        constexprs={
            "HAS_WEIGHTS": has_weights,
            "WEIGHT_GRAD": weight_grad,
            "BLOCK_E": 64,
            "BLOCK_H": BLOCK_H,
        },
    )


def _scatter_spec(dtype: str, has_weights: bool) -> AotSpec:
    return AotSpec(
        kernel=_scatter_kernel,
        signature={
            **{name: f"*{dtype}" for name in ("src_ptr", "out_ptr", "weights_ptr")},
            **{name: "*i32" for name in ("positions_ptr", "bins_ptr", "padded_bins_ptr")},
            **{name: "i32" for name in ("num_experts", "hidden", "top_k")},
        },
        constexprs={
            "HAS_WEIGHTS": has_weights,
            "BLOCK_E": 64,
            "BLOCK_H": BLOCK_H,
        },
    )


AOT_SPECS = (
    # What the block-sparse dMoE launches: top-1 rows without weights, in bf16 and fp32.
    [_gather_spec(dtype, False, False) for dtype in ("bf16", "fp32")]
    + [_scatter_spec(dtype, False) for dtype in ("bf16", "fp32")]
    + [
        AotSpec(
            kernel=_invert_permutation_kernel,
            signature={"indices_ptr": "*i32", "positions_ptr": "*i32", "num_assignments": "i32"},
            constexprs={"BLOCK": INVERT_BLOCK},
        )
    ]
    if TRITON_AVAILABLE
    else []
)
