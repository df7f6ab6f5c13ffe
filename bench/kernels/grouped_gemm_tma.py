"""A persistent grouped GEMM for Hopper: tensor-memory-accelerator (TMA) loads through
device-side descriptors, one program per multiprocessor walking the tiles of all experts, and
optionally the row operand read through an index (a gather fused into the product).

An experiment, not part of the product: the dMoE layer does not use it. It runs at the speed of
torch._grouped_mm's CUTLASS kernel, not faster, and fusing the gathers gains too little to close
the layer's gap because the weight gradient cannot read gathered rows through TMA
(docs/benchmark-log.md, the persistent TMA grouped GEMM and fused gathers). It is kept, tested,
as the starting point for that fusion and for bench/grouped_gemm_tma.py. The portable kernels
the layer runs where torch._grouped_mm is missing are in moe.kernels.grouped_gemm.

`grouped_mm_tma(x, weight, tokens_per_expert)`: rows bins[e-1]:bins[e] (bins = cumsum of
tokens_per_expert) times weight[e] ([E, K, N]) or, with transpose_weight, weight[e]^T ([E, N, K]);
with row_index, row r of the product reads x[row_index[r]] (rows sorted by expert, x in token
order). `weight_grad_tma(x, grad_out, tokens_per_expert)`: weight[e] = x_e^T @ grad_out_e, either
operand optionally read through row_index. References: moe.kernels.grouped_gemm's.

Its AOT_SPECS are not built by tools/compile_kernels.py, which collects megatron.kernels and
moe.kernels only; tests/bench/kernels/test_grouped_gemm_tma.py compiles them.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.kernels.dispatch import TRITON_AVAILABLE
from moe.kernels.grouped_gemm import HOPPER_ROW_TILE_SIZES, TileSizes, _exclusive_cumsum

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from megatron.kernels.aot import AotSpec
    from moe.kernels.grouped_gemm_kernels import _tile_coords


def available() -> bool:
    """Device-side tensor descriptors (tl.make_tensor_descriptor) arrived in Triton 3.3-3.4."""
    return (
        TRITON_AVAILABLE
        and hasattr(tl, "make_tensor_descriptor")
        and hasattr(triton, "set_allocator")
    )


# The launch shape is grouped_gemm's TileSizes; its Hopper row-product shape (128 x 256 tiles,
# 64 deep, 8 warps, 3 stages) was also the fastest here, for both kernels
# (bench/grouped_gemm_tma.py; docs/benchmark-log.md).
HOPPER_TILES = HOPPER_ROW_TILE_SIZES


def _num_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few programs, so that each walks several tiles


def _use_torch_allocator(device: torch.device) -> None:
    # Device-side descriptors live in a global scratch buffer that Triton asks the host for at
    # launch; torch's allocator gives it (inside a CUDA graph capture too).
    triton.set_allocator(
        lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device)
    )


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"{message} (bench/kernels/grouped_gemm_tma.py)")


def _check_dtype(*tensors: torch.Tensor) -> None:
    # On a GPU tl.dot would multiply fp32 in TF32; the kernels are for 16-bit training. The
    # interpreter (the CPU tests) computes in full precision whatever the dtype.
    dtypes = {tensor.dtype for tensor in tensors}
    _check(len(dtypes) == 1, f"operands of one dtype; got {sorted(map(str, dtypes))}")
    _check(
        not tensors[0].is_cuda or tensors[0].dtype in (torch.bfloat16, torch.float16),
        f"bf16 or fp16 on the GPU; got {tensors[0].dtype}",
    )


def grouped_mm_tma(
    x: torch.Tensor,
    weight: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    *,
    transpose_weight: bool = False,
    row_index: Optional[torch.Tensor] = None,
    tiles: TileSizes = HOPPER_TILES,
) -> torch.Tensor:
    """[rows, N] = per-expert x_e @ weight[e] (or weight[e]^T); see the module docstring."""
    _check(available(), "needs Triton with device-side tensor descriptors (3.4 or newer)")
    _check(
        x.dim() == 2 and weight.dim() == 3,
        f"x [rows, K] and weight [E, ., .]; got {tuple(x.shape)}, {tuple(weight.shape)}",
    )
    experts = weight.shape[0]
    reduce_size = x.shape[1]
    out_cols = weight.shape[1] if transpose_weight else weight.shape[2]
    _check(
        (weight.shape[2] if transpose_weight else weight.shape[1]) == reduce_size,
        f"x has {reduce_size} columns; weight {tuple(weight.shape)} (transpose_weight={transpose_weight})",
    )
    # Without a transposed weight the K tiles walk weight viewed as [E * K, N] and must not
    # cross into the next expert; a gathered row is read whole K tiles at a time.
    _check(
        (transpose_weight and row_index is None) or reduce_size % tiles.block_k == 0,
        f"K={reduce_size} must be a multiple of block_k={tiles.block_k} here",
    )
    _check(x.is_contiguous() and weight.is_contiguous(), "x and weight must be contiguous")
    _check_dtype(x, weight)
    num_rows = x.shape[0] if row_index is None else row_index.shape[0]
    out = torch.empty(num_rows, out_cols, device=x.device, dtype=x.dtype)
    if num_rows == 0 or out_cols == 0:
        return out
    row_offsets = _exclusive_cumsum(tokens_per_expert)
    tile_offsets = _exclusive_cumsum((tokens_per_expert + tiles.block_m - 1) // tiles.block_m)
    _use_torch_allocator(x.device)
    programs = _num_programs(x.device)
    _rows_kernel[(programs,)](
        x,
        x if row_index is None else row_index.to(torch.int32),
        weight,
        out,
        row_offsets,
        tile_offsets,
        experts,
        num_rows,
        x.shape[0],
        reduce_size,
        out_cols,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        BLOCK_E=max(16, triton.next_power_of_2(experts)),
        GROUP_M=tiles.group_m,
        NUM_PROGRAMS=programs,
        TRANSPOSE_WEIGHT=transpose_weight,
        GATHER=row_index is not None,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out


def weight_grad_tma(
    x: torch.Tensor,
    grad_out: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    *,
    row_index: Optional[torch.Tensor] = None,
    gather: Optional[str] = None,
    tiles: TileSizes = HOPPER_TILES,
) -> torch.Tensor:
    """[E, K, N]: weight[e] = x_e^T @ grad_out_e. gather="x" or "grad_out" reads that operand
    through row_index (the other one is in expert order)."""
    _check(available(), "needs Triton with device-side tensor descriptors (3.4 or newer)")
    _check(
        gather in (None, "x", "grad_out"), f"gather must be None, 'x' or 'grad_out'; got {gather!r}"
    )
    _check((gather is None) == (row_index is None), "row_index goes with gather='x' or 'grad_out'")
    experts = tokens_per_expert.shape[0]
    in_features, out_features = x.shape[1], grad_out.shape[1]
    _check(
        in_features % tiles.block_m == 0,
        f"x's {in_features} columns must be a multiple of block_m={tiles.block_m}",
    )
    _check(x.is_contiguous() and grad_out.is_contiguous(), "x and grad_out must be contiguous")
    _check_dtype(x, grad_out)
    out = torch.empty(experts, in_features, out_features, device=x.device, dtype=x.dtype)
    if out.numel() == 0:
        return out
    _use_torch_allocator(x.device)
    programs = _num_programs(x.device)
    _weight_grad_kernel[(programs,)](
        x,
        grad_out,
        x if row_index is None else row_index.to(torch.int32),
        out,
        _exclusive_cumsum(tokens_per_expert),
        experts,
        in_features,
        out_features,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_T=tiles.block_k,
        NUM_PROGRAMS=programs,
        GATHER_X=gather == "x",
        GATHER_GRAD=gather == "grad_out",
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out


if TRITON_AVAILABLE:

    @triton.jit
    def _expert_of(row_tile, row_offsets_ptr, tile_offsets_ptr, num_experts, BLOCK_E: tl.constexpr):
        """(expert, its first row, its end row, its first row tile) for a row tile."""
        experts = tl.arange(0, BLOCK_E)
        ends = tl.load(tile_offsets_ptr + 1 + experts, mask=experts < num_experts, other=2147483647)
        expert = tl.sum((ends <= row_tile).to(tl.int32), axis=0)
        return (
            expert,
            tl.load(row_offsets_ptr + expert),
            tl.load(row_offsets_ptr + expert + 1),
            tl.load(tile_offsets_ptr + expert),
        )

    @triton.jit
    def _rows_kernel(
        x_ptr,
        row_index_ptr,
        w_ptr,
        out_ptr,
        row_offsets_ptr,
        tile_offsets_ptr,
        num_experts,
        num_rows,
        x_rows,
        K,
        N,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_E: tl.constexpr,
        GROUP_M: tl.constexpr,
        NUM_PROGRAMS: tl.constexpr,
        TRANSPOSE_WEIGHT: tl.constexpr,
        GATHER: tl.constexpr,
    ):
        x_desc = tl.make_tensor_descriptor(
            x_ptr, shape=[x_rows, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K]
        )
        if TRANSPOSE_WEIGHT:
            w_desc = tl.make_tensor_descriptor(
                w_ptr, shape=[num_experts * N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K]
            )
        else:
            w_desc = tl.make_tensor_descriptor(
                w_ptr, shape=[num_experts * K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N]
            )
        num_row_tiles = tl.load(tile_offsets_ptr + num_experts)
        num_col_tiles = tl.cdiv(N, BLOCK_N)
        # The epilogue recomputes its tile from its own counter, as Triton's persistent matmul
        # tutorial does, so that the flattened loop's prologue and epilogue share no values.
        tile_id_out = tl.program_id(0) - NUM_PROGRAMS
        for tile_id in tl.range(
            tl.program_id(0), num_row_tiles * num_col_tiles, NUM_PROGRAMS, flatten=True
        ):
            row_tile, col_tile = _tile_coords(tile_id, num_row_tiles, num_col_tiles, GROUP_M)
            expert, row_begin, row_end, first_tile = _expert_of(
                row_tile, row_offsets_ptr, tile_offsets_ptr, num_experts, BLOCK_E
            )
            m0 = row_begin + (row_tile - first_tile) * BLOCK_M
            n0 = col_tile * BLOCK_N
            if GATHER:
                # Rows past the expert's end read some token's row: only outputs the store drops.
                rows = m0 + tl.arange(0, BLOCK_M)
                source = tl.load(row_index_ptr + rows, mask=rows < num_rows, other=0)
                x_ptrs = x_ptr + source.to(tl.int64)[:, None] * K + tl.arange(0, BLOCK_K)[None, :]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                if GATHER:
                    a = tl.load(x_ptrs + k0)
                else:
                    a = x_desc.load([m0, k0])
                if TRANSPOSE_WEIGHT:
                    b = w_desc.load([expert * N + n0, k0]).T
                else:
                    b = w_desc.load([expert * K + k0, n0])
                acc = tl.dot(a, b, acc)

            tile_id_out += NUM_PROGRAMS
            row_tile, col_tile = _tile_coords(tile_id_out, num_row_tiles, num_col_tiles, GROUP_M)
            _, row_begin, row_end, first_tile = _expert_of(
                row_tile, row_offsets_ptr, tile_offsets_ptr, num_experts, BLOCK_E
            )
            rows = row_begin + (row_tile - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(
                out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :],
                acc.to(out_ptr.dtype.element_ty),
                mask=(rows[:, None] < row_end) & (cols[None, :] < N),
            )

    @triton.jit
    def _weight_grad_kernel(
        x_ptr,
        grad_ptr,
        row_index_ptr,
        out_ptr,
        row_offsets_ptr,
        num_experts,
        K,
        N,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_T: tl.constexpr,
        NUM_PROGRAMS: tl.constexpr,
        GATHER_X: tl.constexpr,
        GATHER_GRAD: tl.constexpr,
    ):
        out_desc = tl.make_tensor_descriptor(
            out_ptr, shape=[num_experts * K, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N]
        )
        m_tiles = tl.cdiv(K, BLOCK_M)
        n_tiles = tl.cdiv(N, BLOCK_N)
        for tile_id in tl.range(tl.program_id(0), num_experts * m_tiles * n_tiles, NUM_PROGRAMS):
            expert = tile_id // (m_tiles * n_tiles)
            m0 = (tile_id % (m_tiles * n_tiles)) // n_tiles * BLOCK_M
            n0 = tile_id % n_tiles * BLOCK_N
            row_begin = tl.load(row_offsets_ptr + expert)
            rows = tl.load(row_offsets_ptr + expert + 1) - row_begin
            # Per-expert descriptors: TMA fills the rows past the expert's end with zeros, which
            # is what masks the sum. (A shape of 0 is not allowed; an expert without rows runs
            # no iteration and stores zeros.)
            x_desc = tl.make_tensor_descriptor(
                x_ptr + row_begin.to(tl.int64) * K,
                shape=[tl.maximum(rows, 1), K],
                strides=[K, 1],
                block_shape=[BLOCK_T, BLOCK_M],
            )
            grad_desc = tl.make_tensor_descriptor(
                grad_ptr + row_begin.to(tl.int64) * N,
                shape=[tl.maximum(rows, 1), N],
                strides=[N, 1],
                block_shape=[BLOCK_T, BLOCK_N],
            )
            if GATHER_X or GATHER_GRAD:
                # The next block's index is loaded an iteration ahead, so that the row loads do
                # not wait on a load issued in their own iteration (docs/benchmark-log.md).
                ts = tl.arange(0, BLOCK_T)
                next_source = tl.load(row_index_ptr + row_begin + ts, mask=ts < rows, other=0)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for t0 in range(0, rows, BLOCK_T):
                if GATHER_X or GATHER_GRAD:
                    source = next_source.to(tl.int64)
                    ts = t0 + BLOCK_T + tl.arange(0, BLOCK_T)
                    next_source = tl.load(row_index_ptr + row_begin + ts, mask=ts < rows, other=0)
                # A gathered operand reads some token's row past the expert's end, unmasked:
                # the other operand is zero there.
                if GATHER_X:
                    xs = tl.load(
                        x_ptr + source[:, None] * K + (m0 + tl.arange(0, BLOCK_M))[None, :]
                    )
                else:
                    xs = x_desc.load([t0, m0])
                if GATHER_GRAD:
                    # Columns past N (N need not be a multiple of BLOCK_N) would read the next
                    # row, or past the end of the tensor for its last row: masked.
                    grad_cols = n0 + tl.arange(0, BLOCK_N)
                    grads = tl.load(
                        grad_ptr + source[:, None] * N + grad_cols[None, :],
                        mask=(grad_cols < N)[None, :],
                        other=0.0,
                    )
                else:
                    grads = grad_desc.load([t0, n0])
                acc = tl.dot(xs.T, grads, acc)
            out_desc.store([expert * K + m0, n0], acc.to(out_ptr.dtype.element_ty))


def _aot_specs() -> list:
    common = {"BLOCK_M": 128, "BLOCK_N": 256, "NUM_PROGRAMS": 132}
    rows = [
        AotSpec(
            kernel=_rows_kernel,
            signature={
                "x_ptr": "*bf16",
                "row_index_ptr": "*i32",
                "w_ptr": "*bf16",
                "out_ptr": "*bf16",
                "row_offsets_ptr": "*i32",
                "tile_offsets_ptr": "*i32",
                **{name: "i32" for name in ("num_experts", "num_rows", "x_rows", "K", "N")},
            },
            constexprs={
                **common,
                "BLOCK_K": 64,
                "BLOCK_E": 64,
                "GROUP_M": 8,
                "TRANSPOSE_WEIGHT": transpose,
                "GATHER": gather,
            },
        )
        for transpose in (False, True)
        for gather in (False, True)
    ]
    weight_grads = [
        AotSpec(
            kernel=_weight_grad_kernel,
            signature={
                "x_ptr": "*bf16",
                "grad_ptr": "*bf16",
                "row_index_ptr": "*i32",
                "out_ptr": "*bf16",
                "row_offsets_ptr": "*i32",
                **{name: "i32" for name in ("num_experts", "K", "N")},
            },
            constexprs={**common, "BLOCK_T": 64, "GATHER_X": gather_x, "GATHER_GRAD": gather_grad},
        )
        for gather_x, gather_grad in ((False, False), (True, False), (False, True))
    ]
    return rows + weight_grads


# Every variant of both kernels, in bf16 (see the module docstring for who builds them).
AOT_SPECS = _aot_specs() if available() else []
