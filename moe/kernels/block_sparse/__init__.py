"""Block-sparse matrix products for the dropless MoE expert MLP (MegaBlocks' formulation).

A block-sparse matrix is a `Topology` (which [B, B] blocks are nonzero) plus data [nnz, B, B]
in the topology's row-major order. Ops: `sdd` (dense @ dense -> sparse), `dsd` (sparse @
dense), `dsd_t` (sparse^T @ dense), `dds_t` (dense^T @ sparse) and `sparse_mlp`.
"""

from moe.kernels.block_sparse.kernels import AOT_SPECS
from moe.kernels.block_sparse.ops import dds_t, dsd, dsd_t, sdd, sparse_mlp
from moe.kernels.block_sparse.topology import Topology

__all__ = ["AOT_SPECS", "Topology", "dds_t", "dsd", "dsd_t", "sdd", "sparse_mlp"]
