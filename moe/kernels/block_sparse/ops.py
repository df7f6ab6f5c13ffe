"""Public block-sparse ops (Triton kernel on GPU, PyTorch reference elsewhere) and the dMoE MLP.

`sparse_mlp` is one autograd.Function so that its backward can call the transposed products
directly and choose what to keep for backward (see `SparseMLP`).
"""

from __future__ import annotations

import torch

from megatron.kernels.dispatch import use_triton
from moe.kernels.block_sparse import kernels, reference
from moe.kernels.block_sparse.topology import Topology

ACTIVATIONS = ("gelu",)


def _check(op: str, topology: Topology, **tensors: torch.Tensor) -> None:
    dtypes = {tensor.dtype for tensor in tensors.values()}
    if len(dtypes) != 1:
        found = ", ".join(f"{name}={tensor.dtype}" for name, tensor in tensors.items())
        raise TypeError(f"{op}: operands must share one dtype, got {found}; cast them first.")
    for name, tensor in tensors.items():
        if tensor.dim() != (3 if name == "data" else 2):
            raise ValueError(f"{op}: {name} has shape {tuple(tensor.shape)}, wrong rank.")
    data = tensors.get("data")
    if data is not None and tuple(data.shape) != (topology.nnz, *(topology.block_size,) * 2):
        raise ValueError(
            f"{op}: data has shape {tuple(data.shape)} but the topology needs "
            f"[{topology.nnz}, {topology.block_size}, {topology.block_size}]."
        )


def sdd(x: torch.Tensor, w: torch.Tensor, topology: Topology) -> torch.Tensor:
    """Nonzero blocks of x [M, K] @ w [K, N] -> data [nnz, B, B]; w may be a strided view."""
    _check("sdd", topology, x=x, w=w)
    if x.shape[0] != topology.num_rows or w.shape[1] != topology.num_columns:
        raise ValueError(
            f"sdd: x {tuple(x.shape)} @ w {tuple(w.shape)} does not match the topology's "
            f"[{topology.num_rows}, {topology.num_columns}]."
        )
    if use_triton(x, w):
        return kernels.sdd_triton(x, w, topology)
    return reference.sdd_reference(x, w, topology)


def dsd(data: torch.Tensor, topology: Topology, w: torch.Tensor) -> torch.Tensor:
    """Block-sparse [M, N] @ w [N, H] -> [M, H]; w may be a strided view."""
    _check("dsd", topology, data=data, w=w)
    if w.shape[0] != topology.num_columns:
        raise ValueError(f"dsd: w has {w.shape[0]} rows, the topology {topology.num_columns}.")
    if use_triton(data, w):
        return kernels.dsd_triton(data, topology, w)
    return reference.dsd_reference(data, topology, w)


def dsd_t(data: torch.Tensor, topology: Topology, y: torch.Tensor) -> torch.Tensor:
    """Block-sparse^T [N, M] @ y [M, H] -> [N, H] (e.g. dw2 = act^T @ dout)."""
    _check("dsd_t", topology, data=data, y=y)
    if y.shape[0] != topology.num_rows:
        raise ValueError(f"dsd_t: y has {y.shape[0]} rows, the topology {topology.num_rows}.")
    if use_triton(data, y):
        return kernels.dsd_t_triton(data, topology, y)
    return reference.dsd_t_reference(data, topology, y)


def dds_t(x: torch.Tensor, data: torch.Tensor, topology: Topology) -> torch.Tensor:
    """x^T [K, M] @ block-sparse [M, N] -> [K, N] (e.g. dw1 = x^T @ dh1)."""
    _check("dds_t", topology, x=x, data=data)
    if x.shape[0] != topology.num_rows:
        raise ValueError(f"dds_t: x has {x.shape[0]} rows, the topology {topology.num_rows}.")
    if use_triton(x, data):
        return kernels.dds_t_triton(x, data, topology)
    return reference.dds_t_reference(x, data, topology)


class SparseMLP(torch.autograd.Function):
    """out = gelu(x @ w1 restricted to the topology) @ w2, with block-sparse kernels both ways.

    Memory: only the pre-activation h1 ([nnz, B, B], M*F values) is saved besides x, w1, w2;
    gelu(h1) is recomputed in backward for dw2. This halves the sparse activations each layer
    holds from forward to backward, for one extra elementwise pass over h1.
    """

    @staticmethod
    def forward(ctx, x, w1, w2, topology):
        h1 = sdd(x, w1, topology)
        out = dsd(_gelu(h1), topology, w2)
        ctx.save_for_backward(x, w1, w2, h1)
        ctx.topology = topology
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, w1, w2, h1 = ctx.saved_tensors
        topology = ctx.topology
        grad_out = grad_out.contiguous()
        grad_w2 = dsd_t(_gelu(h1), topology, grad_out)
        grad_act = sdd(grad_out, w2.t(), topology)
        grad_h1 = torch.ops.aten.gelu_backward(grad_act, h1, approximate="tanh")
        grad_x = dsd(grad_h1, topology, w1.t()) if ctx.needs_input_grad[0] else None
        grad_w1 = dds_t(x, grad_h1, topology)
        return grad_x, grad_w1, grad_w2, None


def _gelu(h: torch.Tensor) -> torch.Tensor:
    # Elementwise, so it applies to the [nnz, B, B] blocks directly.
    return torch.nn.functional.gelu(h, approximate="tanh")


def sparse_mlp(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topology: Topology,
    activation: str = "gelu",
) -> torch.Tensor:
    """dMoE expert MLP on expert-sorted, block-padded x [M, H]: w1 [H, E*F], w2 [E*F, H]."""
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"sparse_mlp: activation={activation!r} is not supported; choose from {ACTIVATIONS}."
        )
    if w1.shape != (x.shape[1], topology.num_columns) or w2.shape != (
        topology.num_columns,
        x.shape[1],
    ):
        raise ValueError(
            f"sparse_mlp: w1 {tuple(w1.shape)} and w2 {tuple(w2.shape)} must be "
            f"[{x.shape[1]}, {topology.num_columns}] and [{topology.num_columns}, {x.shape[1]}]."
        )
    return SparseMLP.apply(x, w1, w2, topology)
