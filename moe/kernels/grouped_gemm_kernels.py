"""The grouped GEMM's Triton kernels, their launch shape (`TileSizes`) and their AOT_SPECS.

moe.kernels.grouped_gemm launches them (its module docstring has the op, its backends and its
reference); here is the device code:
- `_grouped_mm_kernel`: out[rows of e] = a[rows of e] @ B_e, with B_e read through strides so
  that the same kernel computes the forward (B_e = weight[e]) and the input gradient
  (B_e = weight[e]^T);
- `_grouped_weight_grad_kernel`: grad_weight[e] = x_e^T @ grad_out_e;
and `TileSizes`, the launch shape both take, with the one `default_tile_sizes` picks per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.kernels.dispatch import TRITON_AVAILABLE

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from megatron.kernels.aot import AotSpec


@dataclass(frozen=True)
class TileSizes:
    """Launch shape of the Triton kernels.

    block_m/block_n/block_k: tile sizes, each a power of two and at least 16 (tl.dot). In the
    weight-gradient kernel block_m tiles the weight's rows and block_k the tokens.
    group_m: row tiles that share one band of the launch order, so that the programs running at
    once reuse the same expert-weight tiles from L2 (Triton's matmul tutorial's grouped order).
    num_warps/num_stages: Triton's warps per program and software-pipelining depth.
    """

    block_m: int = 64
    block_n: int = 64
    block_k: int = 32
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


DEFAULT_TILE_SIZES = TileSizes()
# The fastest shapes on an H100 at the first two configurations (bench/grouped_products.py
# --sweep; docs/benchmark-log.md). Their shared memory (144 and 96 KiB at 2-byte elements) fits
# Hopper's 227 KiB; other GPUs (AMD's 64 KiB LDS among them) and fp32 keep the default.
HOPPER_ROW_TILE_SIZES = TileSizes(block_m=128, block_n=256, block_k=64, num_warps=8)
HOPPER_WEIGHT_GRAD_TILE_SIZES = TileSizes(block_m=128, block_n=128, block_k=64)


def default_tile_sizes(x: torch.Tensor, weight_grad: bool) -> TileSizes:
    """The Triton kernels' launch shape for operands like x on x's device."""
    hopper = (
        x.is_cuda
        and torch.version.hip is None
        and x.element_size() == 2
        and torch.cuda.get_device_capability(x.device)[0] >= 9
    )
    if not hopper:
        return DEFAULT_TILE_SIZES
    return HOPPER_WEIGHT_GRAD_TILE_SIZES if weight_grad else HOPPER_ROW_TILE_SIZES


if TRITON_AVAILABLE:

    @triton.jit
    def _tile_coords(tile_id, num_row_tiles, num_col_tiles, GROUP_M: tl.constexpr):
        """(row tile, column tile) of tile_id: bands of GROUP_M row tiles, column by column."""
        band = GROUP_M * num_col_tiles
        first = (tile_id // band) * GROUP_M
        band_rows = tl.minimum(num_row_tiles - first, GROUP_M)
        return first + (tile_id % band) % band_rows, (tile_id % band) // band_rows

    @triton.jit
    def _grouped_mm_kernel(
        a_ptr,
        b_ptr,
        out_ptr,
        row_offsets_ptr,
        tile_offsets_ptr,
        num_experts,
        num_rows,
        reduce_size,
        out_cols,
        num_row_tiles,
        stride_am,
        stride_ak,
        stride_be,
        stride_bk,
        stride_bn,
        stride_om,
        stride_on,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_E: tl.constexpr,
        GROUP_M: tl.constexpr,
        EVEN_K: tl.constexpr,
        EVEN_N: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
    ):
        """out[rows of e] = a[rows of e] @ B_e, B_e[k, n] = b[e*stride_be + k*stride_bk + n*stride_bn].

        One program per (row tile, column tile); row tiles are numbered expert after expert
        (tile_offsets) and bands of GROUP_M of them run column tile by column tile, so that the
        programs in flight share expert-weight tiles in L2.
        """
        tile, col_block = _tile_coords(
            tl.program_id(0), num_row_tiles, tl.cdiv(out_cols, BLOCK_N), GROUP_M
        )

        # The expert owning this row tile: how many experts' tiles end at or before it.
        experts = tl.arange(0, BLOCK_E)
        tile_ends = tl.load(
            tile_offsets_ptr + 1 + experts, mask=experts < num_experts, other=2147483647
        )
        expert = tl.sum((tile_ends <= tile).to(tl.int32), axis=0)
        if expert >= num_experts:
            return
        expert_first_tile = tl.load(tile_offsets_ptr + expert)
        row_begin = tl.load(row_offsets_ptr + expert)
        row_end = tl.load(row_offsets_ptr + expert + 1)

        rows = row_begin + (tile - expert_first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
        # Loads need no row or column mask: rows past the expert's end read the next expert's
        # rows (or wrap), columns past the end wrap; both only feed outputs the store drops.
        load_rows = (rows % num_rows).to(tl.int64)
        load_cols = cols if EVEN_N else cols % out_cols
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + load_rows[:, None] * stride_am + ks[None, :] * stride_ak
        b_ptrs = (
            b_ptr
            + expert.to(tl.int64) * stride_be
            + ks[:, None] * stride_bk
            + load_cols[None, :] * stride_bn
        )

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k_start in range(0, reduce_size, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_mask = k_start + ks < reduce_size
                a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk

        rows = rows.to(tl.int64)
        out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
        store_mask = (rows[:, None] < row_end) & (cols[None, :] < out_cols)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=store_mask)

    @triton.jit
    def _grouped_weight_grad_kernel(
        x_ptr,
        grad_out_ptr,
        grad_weight_ptr,
        row_offsets_ptr,
        in_features,
        out_features,
        stride_xm,
        stride_xk,
        stride_gm,
        stride_gn,
        stride_we,
        stride_wk,
        stride_wn,
        BLOCK_K: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_T: tl.constexpr,
        EVEN_TILES: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
    ):
        """grad_weight[e, k tile, n tile] = sum over the rows t of expert e of x[t, k] * grad_out[t, n]."""
        pid = tl.program_id(0)
        num_n_tiles = tl.cdiv(out_features, BLOCK_N)
        tiles_per_expert = tl.cdiv(in_features, BLOCK_K) * num_n_tiles
        expert = pid // tiles_per_expert
        within = pid % tiles_per_expert
        ks = (within // num_n_tiles) * BLOCK_K + tl.arange(0, BLOCK_K)
        ns = (within % num_n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_begin = tl.load(row_offsets_ptr + expert)
        row_end = tl.load(row_offsets_ptr + expert + 1)
        # Columns past the end wrap instead of being masked: they only feed outputs the store drops.
        load_ks = ks if EVEN_TILES else ks % in_features
        load_ns = ns if EVEN_TILES else ns % out_features

        # An expert without rows runs no iteration and stores zeros, the gradient it must get.
        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        for t_start in range(row_begin, row_end, BLOCK_T):
            ts = t_start + tl.arange(0, BLOCK_T)
            # Rows past the expert's end belong to another expert: these masks are the sum's.
            t_mask = ts < row_end
            ts = ts.to(tl.int64)
            x_t = tl.load(
                x_ptr + ts[None, :] * stride_xm + load_ks[:, None] * stride_xk,
                mask=t_mask[None, :],
                other=0.0,
            )
            grads = tl.load(
                grad_out_ptr + ts[:, None] * stride_gm + load_ns[None, :] * stride_gn,
                mask=t_mask[:, None],
                other=0.0,
            )
            acc = tl.dot(x_t, grads, acc, input_precision=INPUT_PRECISION)

        out_ptrs = (
            grad_weight_ptr
            + expert.to(tl.int64) * stride_we
            + ks[:, None] * stride_wk
            + ns[None, :] * stride_wn
        )
        tl.store(
            out_ptrs,
            acc.to(grad_weight_ptr.dtype.element_ty),
            mask=(ks[:, None] < in_features) & (ns[None, :] < out_features),
        )


def _grouped_mm_spec(dtype: str, tile_sizes: TileSizes = DEFAULT_TILE_SIZES) -> AotSpec:
    return AotSpec(
        kernel=_grouped_mm_kernel,
        signature={
            **{name: f"*{dtype}" for name in ("a_ptr", "b_ptr", "out_ptr")},
            **{name: "*i32" for name in ("row_offsets_ptr", "tile_offsets_ptr")},
            **{
                name: "i32"
                for name in (
                    "num_experts",
                    "num_rows",
                    "reduce_size",
                    "out_cols",
                    "num_row_tiles",
                    "stride_am",
                    "stride_ak",
                    "stride_be",
                    "stride_bk",
                    "stride_bn",
                    "stride_om",
                    "stride_on",
                )
            },
        },
        constexprs={
            "BLOCK_M": tile_sizes.block_m,
            "BLOCK_N": tile_sizes.block_n,
            "BLOCK_K": tile_sizes.block_k,
            "BLOCK_E": 64,
            "GROUP_M": tile_sizes.group_m,
            "EVEN_K": False,
            "EVEN_N": False,
            "INPUT_PRECISION": "ieee",
        },
    )


def _weight_grad_spec(dtype: str, tile_sizes: TileSizes = DEFAULT_TILE_SIZES) -> AotSpec:
    return AotSpec(
        kernel=_grouped_weight_grad_kernel,
        signature={
            **{name: f"*{dtype}" for name in ("x_ptr", "grad_out_ptr", "grad_weight_ptr")},
            "row_offsets_ptr": "*i32",
            **{
                name: "i32"
                for name in (
                    "in_features",
                    "out_features",
                    "stride_xm",
                    "stride_xk",
                    "stride_gm",
                    "stride_gn",
                    "stride_we",
                    "stride_wk",
                    "stride_wn",
                )
            },
        },
        constexprs={
            "BLOCK_K": tile_sizes.block_m,
            "BLOCK_N": tile_sizes.block_n,
            "BLOCK_T": tile_sizes.block_k,
            "EVEN_TILES": False,
            "INPUT_PRECISION": "ieee",
        },
    )


# What `python tools/compile_kernels.py` builds: both kernels (forward and input gradient share the
# first) for each dtype the Triton path takes.
AOT_SPECS = (
    [_grouped_mm_spec(dtype) for dtype in ("bf16", "fp16", "fp32")]
    + [_weight_grad_spec(dtype) for dtype in ("bf16", "fp16", "fp32")]
    if TRITON_AVAILABLE
    else []
)
