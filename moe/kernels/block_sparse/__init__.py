"""Block-sparse matrix products for the dropless MoE expert MLP (MegaBlocks' formulation).

A block-sparse matrix is a `Topology` (which [B, B] blocks are nonzero) plus data [nnz, B, B]
in the topology's row-major order. Ops: `sdd` (dense @ dense -> sparse), `dsd` (sparse @
dense), `dsd_t` (sparse^T @ dense), `dds_t` (dense^T @ sparse) and `sparse_mlp`.
"""

from megatron.kernels.dispatch import TRITON_AVAILABLE
from moe.kernels.block_sparse.ops import dds_t, dsd, dsd_t, sdd, sparse_mlp
from moe.kernels.block_sparse.topology import Topology

# tools/compile_kernels.py collects AOT_SPECS from each module of moe.kernels, this package included.
if TRITON_AVAILABLE:
    from moe.kernels.block_sparse.kernels import AOT_SPECS
else:
    AOT_SPECS = []

__all__ = ["AOT_SPECS", "Topology", "dds_t", "dsd", "dsd_t", "sdd", "sparse_mlp"]
