"""The one-tensor collectives under the names the running torch gives them, and the functional
forms the model's own collectives use.

torch 2.13 names them `reduce_scatter_single` and `all_gather_single` and deprecates the older
`reduce_scatter_tensor` and `all_gather_into_tensor`, which are all that torch 2.4-2.12 have.
Gloo runs these one-tensor forms on every supported torch (its list-form reduce_scatter only
from torch 2.8).

Collectives inside the model (the tensor-parallel mappings, the vocabulary-parallel loss, FP8's
amax reductions) use torch's functional collectives instead: they return a new tensor, which
torch.compile traces as a collective and a wait on its result. torch.compile rewrites an
in-place `dist.all_reduce` into a functional collective copied back into its input, and on
NCCL the compiled backward read that input before the reduction had finished: the gradients a
column-parallel layer's input all-reduces came out partial (TP2 on two GPUs, whole-model
compile: grad norm 1.03 where one GPU has 1.36). Eager runs wait on the result at once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as functional

reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_functional_all_gather = (
    getattr(functional, "all_gather_single", None) or functional.all_gather_tensor
)
_functional_reduce_scatter = (
    getattr(functional, "reduce_scatter_single", None) or functional.reduce_scatter_tensor
)


def _waited(tensor: torch.Tensor) -> torch.Tensor:
    """A functional collective's result as a plain tensor: in eager mode it comes back as an
    AsyncCollectiveTensor, which would otherwise wait only at its first use (and reach autograd
    as a tensor subclass); traced, it is already the waited result."""
    if isinstance(tensor, functional.AsyncCollectiveTensor):
        return tensor.wait()
    return tensor


def all_reduce_result(
    tensor: torch.Tensor, group: dist.ProcessGroup, op: str = "sum"
) -> torch.Tensor:
    """A new tensor: `tensor` reduced (`op`: "sum" or "max") over `group`; `tensor` unchanged."""
    return _waited(functional.all_reduce(tensor, op, group))


def all_gather_result(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """A new tensor: every rank's `tensor` concatenated along `dim`, in rank order."""
    return _waited(_functional_all_gather(tensor.contiguous(), dim, group))


def reduce_scatter_result(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """A new tensor: `tensor` summed over `group`, this rank's chunk along `dim`."""
    return _waited(_functional_reduce_scatter(tensor.contiguous(), "sum", dim, group))
