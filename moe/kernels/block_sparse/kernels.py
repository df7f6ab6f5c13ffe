"""Triton kernels for the block-sparse products and the launchers the public ops call.

Two kernels cover every product:
- `_sdd_kernel`: one program per nonzero block computes that [B, B] block of a dense @ dense.
- `_sparse_dense_kernel`: one program per (output row block, column tile) walks a compressed
  index of blocks. Walking the row-major index gives sparse @ dense; walking the column-major
  index with the blocks read transposed gives sparse^T @ dense, and writing that result through
  transposed output strides gives dense^T @ sparse.
Both accumulate in fp32 with `tl.dot` and take arbitrary strides for the dense operands, so
transposed weights are passed as views.
"""

from __future__ import annotations

import torch

from megatron.kernels.dispatch import TRITON_AVAILABLE
from moe.kernels.block_sparse.topology import Topology

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from megatron.kernels.aot import AotSpec

MAX_TILE = 64


if TRITON_AVAILABLE:

    @triton.jit
    def _accumulate(acc, a, b, FP32_EXACT: tl.constexpr):
        # TF32 would cost ~1e-3 relative error on fp32 inputs; follow torch's allow_tf32 setting.
        if FP32_EXACT:
            return tl.dot(a, b, acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)

    @triton.jit
    def _sdd_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        row_indices_ptr,
        column_indices_ptr,
        K,
        stride_x_row,
        stride_x_col,
        stride_w_row,
        stride_w_col,
        BLOCK: tl.constexpr,
        BLOCK_K: tl.constexpr,
        FP32_EXACT: tl.constexpr,
    ):
        """out[block] = x[row block rows, :] @ w[:, column block columns] for one nonzero block."""
        block = tl.program_id(0).to(tl.int64)
        row_block = tl.load(row_indices_ptr + block).to(tl.int64)
        column_block = tl.load(column_indices_ptr + block).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        offs_k = tl.arange(0, BLOCK_K)
        rows = row_block * BLOCK + offs
        columns = column_block * BLOCK + offs
        x_ptrs = x_ptr + rows[:, None] * stride_x_row + offs_k[None, :] * stride_x_col
        w_ptrs = w_ptr + offs_k[:, None] * stride_w_row + columns[None, :] * stride_w_col
        # tl.full, not tl.zeros: tl.zeros is itself a @jit function that stays compiled when triton
        # was imported before TRITON_INTERPRET was set, and interpreted kernels cannot call it.
        acc = tl.full((BLOCK, BLOCK), 0.0, dtype=tl.float32)
        for k_start in range(0, K, BLOCK_K):
            k_mask = (k_start + offs_k) < K
            a = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
            acc = _accumulate(acc, a, b, FP32_EXACT)
            x_ptrs += BLOCK_K * stride_x_col
            w_ptrs += BLOCK_K * stride_w_row
        out_ptrs = out_ptr + block * BLOCK * BLOCK + offs[:, None] * BLOCK + offs[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _sparse_dense_kernel(
        data_ptr,
        dense_ptr,
        out_ptr,
        offsets_ptr,
        dense_blocks_ptr,
        block_ids_ptr,
        N,
        stride_block_row,
        stride_block_col,
        stride_dense_row,
        stride_dense_col,
        stride_out_row,
        stride_out_col,
        BLOCK: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PERMUTED: tl.constexpr,
        FP32_EXACT: tl.constexpr,
    ):
        """out[row block, tile] = sum over index entries j of block_j @ dense[dense_blocks[j], tile].

        Entries of output row block r are `offsets[r]:offsets[r + 1]`; entry j uses data block
        `block_ids[j]` when PERMUTED, else block j. Block strides select the block or its transpose.
        """
        out_block = tl.program_id(0).to(tl.int64)
        tile = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        start = tl.load(offsets_ptr + out_block)
        end = tl.load(offsets_ptr + out_block + 1)
        acc = tl.full((BLOCK, BLOCK_N), 0.0, dtype=tl.float32)
        for entry in range(start, end):
            if PERMUTED:
                block_id = tl.load(block_ids_ptr + entry).to(tl.int64)
            else:
                block_id = tl.cast(entry, tl.int64)
            dense_block = tl.load(dense_blocks_ptr + entry).to(tl.int64)
            block_ptrs = (
                data_ptr
                + block_id * BLOCK * BLOCK
                + offs[:, None] * stride_block_row
                + offs[None, :] * stride_block_col
            )
            dense_rows = dense_block * BLOCK + offs
            dense_ptrs = (
                dense_ptr
                + dense_rows[:, None] * stride_dense_row
                + offs_n[None, :] * stride_dense_col
            )
            a = tl.load(block_ptrs)
            b = tl.load(dense_ptrs, mask=n_mask[None, :], other=0.0)
            acc = _accumulate(acc, a, b, FP32_EXACT)
        out_rows = out_block * BLOCK + offs
        out_ptrs = out_ptr + out_rows[:, None] * stride_out_row + offs_n[None, :] * stride_out_col
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask[None, :])


def _tile(size: int) -> int:
    return max(16, min(MAX_TILE, triton.next_power_of_2(size)))


def _fp32_exact(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32


def sdd_triton(x: torch.Tensor, w: torch.Tensor, topology: Topology) -> torch.Tensor:
    """Nonzero blocks of x [M, K] @ w [K, N] as data [nnz, B, B]; w may be a transposed view."""
    block = topology.block_size
    out = torch.empty(topology.nnz, block, block, dtype=x.dtype, device=x.device)
    if topology.nnz == 0:
        return out
    k = x.shape[1]
    _sdd_kernel[(topology.nnz,)](
        x,
        w,
        out,
        topology.row_indices,
        topology.column_indices,
        k,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        BLOCK=block,
        BLOCK_K=_tile(k),
        FP32_EXACT=_fp32_exact(x.dtype),
    )
    return out


def _sparse_dense(
    data: torch.Tensor,
    dense: torch.Tensor,
    out_t: torch.Tensor,
    topology: Topology,
    transposed: bool,
) -> None:
    """Write block-sparse (or its transpose) @ dense into `out_t`, a possibly strided view."""
    block = topology.block_size
    n = dense.shape[1]
    if transposed:
        index = (topology.column_offsets, topology.row_indices_t, topology.block_permutation_t)
        num_out_blocks = topology.num_column_blocks
        block_strides = (1, block)
    else:
        index = (topology.offsets, topology.column_indices, topology.column_indices)
        num_out_blocks = topology.num_row_blocks
        block_strides = (block, 1)
    tile = _tile(n)
    _sparse_dense_kernel[(num_out_blocks, triton.cdiv(n, tile))](
        data,
        dense,
        out_t,
        *index,
        n,
        *block_strides,
        dense.stride(0),
        dense.stride(1),
        out_t.stride(0),
        out_t.stride(1),
        BLOCK=block,
        BLOCK_N=tile,
        PERMUTED=transposed,
        FP32_EXACT=_fp32_exact(data.dtype),
    )


def dsd_triton(data: torch.Tensor, topology: Topology, w: torch.Tensor) -> torch.Tensor:
    """Block-sparse [M, N] @ w [N, H] -> [M, H]."""
    out = torch.empty(topology.num_rows, w.shape[1], dtype=data.dtype, device=data.device)
    if out.numel():
        _sparse_dense(data.contiguous(), w, out, topology, transposed=False)
    return out


def dsd_t_triton(data: torch.Tensor, topology: Topology, y: torch.Tensor) -> torch.Tensor:
    """Block-sparse^T [N, M] @ y [M, H] -> [N, H]."""
    out = torch.empty(topology.num_columns, y.shape[1], dtype=data.dtype, device=data.device)
    if out.numel():
        _sparse_dense(data.contiguous(), y, out, topology, transposed=True)
    return out


def dds_t_triton(x: torch.Tensor, data: torch.Tensor, topology: Topology) -> torch.Tensor:
    """x^T [K, M] @ block-sparse [M, N] -> [K, N], computed as (sparse^T @ x)^T in place."""
    out = torch.empty(x.shape[1], topology.num_columns, dtype=data.dtype, device=data.device)
    if out.numel():
        _sparse_dense(data.contiguous(), x, out.t(), topology, transposed=True)
    return out


# GPU block size 128 with 64-wide tiles for each I/O dtype; fp32 also in its exact (non-TF32) form.
_DTYPES = {"bf16": False, "fp16": False, "fp32": True}
_STRIDES = ("stride_{}_row", "stride_{}_col")


def _strides(*names: str) -> dict[str, str]:
    return {stride.format(name): "i32" for name in names for stride in _STRIDES}


AOT_SPECS = (
    [
        AotSpec(
            kernel=_sdd_kernel,
            signature={
                "x_ptr": f"*{dtype}",
                "w_ptr": f"*{dtype}",
                "out_ptr": f"*{dtype}",
                "row_indices_ptr": "*i32",
                "column_indices_ptr": "*i32",
                "K": "i32",
                **_strides("x", "w"),
            },
            constexprs={"BLOCK": 128, "BLOCK_K": MAX_TILE, "FP32_EXACT": exact},
        )
        for dtype, has_exact in _DTYPES.items()
        for exact in sorted({False, has_exact})
    ]
    + [
        AotSpec(
            kernel=_sparse_dense_kernel,
            signature={
                "data_ptr": f"*{dtype}",
                "dense_ptr": f"*{dtype}",
                "out_ptr": f"*{dtype}",
                "offsets_ptr": "*i32",
                "dense_blocks_ptr": "*i32",
                "block_ids_ptr": "*i32",
                "N": "i32",
                **_strides("block", "dense", "out"),
            },
            constexprs={
                "BLOCK": 128,
                "BLOCK_N": MAX_TILE,
                "PERMUTED": permuted,
                "FP32_EXACT": exact,
            },
        )
        for dtype, has_exact in _DTYPES.items()
        for exact in sorted({False, has_exact})
        for permuted in (False, True)
    ]
    if TRITON_AVAILABLE
    else []
)
