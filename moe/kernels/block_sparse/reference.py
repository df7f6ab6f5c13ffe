"""Pure-PyTorch references for the block-sparse products: gather the blocks, bmm, scatter-add.

They compute the same functions as the Triton kernels (same layouts, same output shapes) and
run anywhere; they materialize [nnz, B, K]-sized gathers, so they are for CPU and checking.
"""

from __future__ import annotations

import torch

from moe.kernels.block_sparse.topology import Topology


def _row_blocks(dense: torch.Tensor, block: int) -> torch.Tensor:
    """[R*B, H] -> [R, B, H] without copying when the layout allows."""
    return dense.unflatten(0, (-1, block))


def sdd_reference(x: torch.Tensor, w: torch.Tensor, topology: Topology) -> torch.Tensor:
    """Nonzero blocks of x [M, K] @ w [K, N] as data [nnz, B, B]."""
    block = topology.block_size
    rows = _row_blocks(x, block)[topology.row_indices.long()]
    columns = w.unflatten(1, (-1, block)).permute(1, 0, 2)[topology.column_indices.long()]
    return torch.bmm(rows, columns)


def dsd_reference(data: torch.Tensor, topology: Topology, w: torch.Tensor) -> torch.Tensor:
    """Block-sparse [M, N] @ w [N, H] -> [M, H]."""
    block = topology.block_size
    partial = torch.bmm(data, _row_blocks(w, block)[topology.column_indices.long()])
    out = data.new_zeros(topology.num_row_blocks, block, w.shape[1])
    return out.index_add_(0, topology.row_indices.long(), partial).flatten(0, 1)


def dsd_t_reference(data: torch.Tensor, topology: Topology, y: torch.Tensor) -> torch.Tensor:
    """Block-sparse^T [N, M] @ y [M, H] -> [N, H]."""
    block = topology.block_size
    partial = torch.bmm(data.transpose(1, 2), _row_blocks(y, block)[topology.row_indices.long()])
    out = data.new_zeros(topology.num_column_blocks, block, y.shape[1])
    return out.index_add_(0, topology.column_indices.long(), partial).flatten(0, 1)


def dds_t_reference(x: torch.Tensor, data: torch.Tensor, topology: Topology) -> torch.Tensor:
    """x^T [K, M] @ block-sparse [M, N] -> [K, N]."""
    return dsd_t_reference(data, topology, x).t().contiguous()
