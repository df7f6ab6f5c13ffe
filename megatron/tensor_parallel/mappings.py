"""Autograd-aware communication over the tensor-model-parallel group.

Each function is a collective in forward paired with its adjoint in backward, so a
tensor-parallel layer is ordinary autograd code with these placed at region borders:

====================================================  ==================  ====================
function                                              forward             backward
====================================================  ==================  ====================
copy_to_tensor_model_parallel_region                  identity            all-reduce
reduce_from_tensor_model_parallel_region              all-reduce          identity
scatter_to_tensor_model_parallel_region (last dim)    split               all-gather
gather_from_tensor_model_parallel_region (last dim)   all-gather          split
scatter_to_sequence_parallel_region                   split               all-gather
gather_from_sequence_parallel_region                  all-gather          reduce-scatter
reduce_scatter_to_sequence_parallel_region            reduce-scatter      all-gather
====================================================  ==================  ====================

Sequence-parallel functions take the sequence dimension as ``dim``. Our activations are
batch-first ``[batch, seq, hidden]``, so it defaults to 1 (Megatron's activations are
``[seq, batch, hidden]`` and use dim 0). A dim-1 chunk is not contiguous in memory, so these
functions copy chunks into contiguous buffers before communicating; the results are the same.

With a tensor-parallel size of 1 every function returns its input unchanged. Inputs are never
modified in place: a tensor handed to a collective might be saved or shared by other autograd
nodes (a residual branch receives the very same gradient tensor). The collectives are torch's
functional ones, which return new tensors (megatron/parallel/collectives.py says why a compiled
model needs them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.parallel import parallel_state
from megatron.parallel.collectives import (
    all_gather_result,
    all_reduce_result,
    reduce_scatter_result,
)


def _world_size() -> int:
    return parallel_state.get_tensor_model_parallel_world_size()


def _group() -> dist.ProcessGroup:
    return parallel_state.get_tensor_model_parallel_group()


def _all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    if _world_size() == 1:
        return tensor
    return all_reduce_result(tensor, _group())


def _check_divisible(tensor: torch.Tensor, dim: int, world_size: int) -> None:
    if tensor.shape[dim] % world_size != 0:
        raise ValueError(
            f"dimension {dim} of a tensor of shape {tuple(tensor.shape)} is not divisible by "
            f"the tensor model parallel size {world_size}; pad it (vocabulary, sequence "
            f"length or hidden size) to a multiple of {world_size}"
        )


def _split(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's chunk of ``tensor`` along ``dim``."""
    world_size = _world_size()
    if world_size == 1:
        return tensor
    _check_divisible(tensor, dim, world_size)
    chunk = tensor.chunk(world_size, dim)[parallel_state.get_tensor_model_parallel_rank()]
    return chunk.contiguous()


def _all_gather(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim``, in rank order."""
    if _world_size() == 1:
        return tensor
    return all_gather_result(tensor, dim, _group())


def _reduce_scatter(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum ``tensor`` over ranks and keep this rank's chunk along ``dim``."""
    world_size = _world_size()
    if world_size == 1:
        return tensor
    _check_divisible(tensor, dim, world_size)
    return reduce_scatter_result(tensor, dim, _group())


class _CopyToTensorModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor) -> torch.Tensor:
        return input_.view_as(input_)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> torch.Tensor:
        return _all_reduce(grad_output)


class _ReduceFromTensorModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor) -> torch.Tensor:
        return _all_reduce(input_)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> torch.Tensor:
        return grad_output


class _ScatterToTensorModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor) -> torch.Tensor:
        return _split(input_, -1)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> torch.Tensor:
        return _all_gather(grad_output, -1)


class _GatherFromTensorModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor) -> torch.Tensor:
        return _all_gather(input_, -1)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> torch.Tensor:
        return _split(grad_output, -1)


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.dim = dim
        return _split(input_, dim)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad_output, ctx.dim), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, input_: torch.Tensor, dim: int, tensor_parallel_output_grad: bool
    ) -> torch.Tensor:
        ctx.dim = dim
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _all_gather(input_, dim)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter(grad_output, ctx.dim), None, None
        return _split(grad_output, ctx.dim), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.dim = dim
        return _reduce_scatter(input_, dim)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad_output, ctx.dim), None


def copy_to_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Enter a tensor-parallel region with a replicated input: identity forward, all-reduce of
    the (per-rank partial) input gradient backward."""
    return _CopyToTensorModelParallelRegion.apply(input_)


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Leave a tensor-parallel region by summing partial results: all-reduce forward, identity
    backward (the gradient of a sum is replicated)."""
    return _ReduceFromTensorModelParallelRegion.apply(input_)


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Keep this rank's chunk of the last dimension; all-gather the gradient backward."""
    return _ScatterToTensorModelParallelRegion.apply(input_)


def gather_from_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's chunk along the last dimension; split the gradient backward."""
    return _GatherFromTensorModelParallelRegion.apply(input_)


def scatter_to_sequence_parallel_region(input_: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Keep this rank's chunk of the sequence dimension ``dim`` (1 for [batch, seq, hidden]);
    all-gather the gradient backward."""
    return _ScatterToSequenceParallelRegion.apply(input_, dim)


def gather_from_sequence_parallel_region(
    input_: torch.Tensor, dim: int = 1, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """All-gather sequence chunks along ``dim`` (1 for [batch, seq, hidden]).

    Backward reduce-scatters, since the consumer is normally a tensor-parallel layer whose
    input gradient is a per-rank partial sum. Pass ``tensor_parallel_output_grad=False`` when
    the consumer is replicated (every rank already has the full gradient): backward then only
    splits.
    """
    return _GatherFromSequenceParallelRegion.apply(input_, dim, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(input_: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Sum partial results over ranks and keep this rank's sequence chunk along ``dim``
    (1 for [batch, seq, hidden]); all-gather the gradient backward."""
    return _ReduceScatterToSequenceParallelRegion.apply(input_, dim)
