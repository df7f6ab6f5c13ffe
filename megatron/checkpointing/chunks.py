"""This rank's tensors as rectangular chunks of the single-process tensors they are parts of.

The sharded checkpoint format (megatron.checkpointing.torch_dist) stores every tensor of a
single-process run under one global name and shape; each rank writes, and reads back, only the
chunks it holds. This module says which chunks those are, from the parameters' attributes:

- tensor parallelism (`tensor_model_parallel`, `partition_dim`, `partition_stride`): rank r of
  T holds blocks r, r + T, ... of the tensor split into T * stride equal blocks along the dim;
- expert parallelism (`megatron.parallel.expert_parameters`): rank r of P holds experts
  [r * E/P, (r + 1) * E/P) of the full [E, ...] tensor (then its tensor-parallel part of them);
- the distributed optimizer: a rank's state of a parameter is one flat range of it, which is a
  few rectangles of the parameter (`flat_range_rectangles`), each then in the blocks above.

A chunk's tensor is a view of what the rank holds (a parameter, an optimizer state), so nothing
is gathered or copied to describe it: saving writes the views, loading copies into them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

from megatron.parallel import parallel_state
from megatron.parallel.dtensors import local_offsets, local_part
from megatron.parallel.expert_parameters import is_expert_parameter

Offsets = Tuple[int, ...]


@dataclass(frozen=True)
class Block:
    """A rectangle of a local tensor (`local_offsets`, `sizes`) and where it lies in the
    single-process tensor (`global_offsets`)."""

    local_offsets: Offsets
    global_offsets: Offsets
    sizes: Offsets


@dataclass
class ChunkedTensor:
    """This rank's chunks of one single-process tensor of shape `global_shape`: (global
    offsets, tensor shaped like the chunk) pairs. The tensors are views of the rank's own."""

    global_shape: torch.Size
    chunks: List[Tuple[Offsets, torch.Tensor]] = field(default_factory=list)


def tensor_blocks(param: torch.Tensor) -> Tuple[torch.Size, List[Block]]:
    """The single-process shape of `param` (or of a tensor shaped and split like it) and the
    blocks of the local tensor in it. One block covering everything when it is not a shard."""
    shape = list(param.shape)
    ndim = len(shape)
    blocks = [Block((0,) * ndim, (0,) * ndim, tuple(shape))]
    expert_block = list(shape)  # this rank's experts, whole along the tensor-parallel dim
    tensor_parallel = parallel_state.get_tensor_model_parallel_world_size()
    if getattr(param, "tensor_model_parallel", False) and tensor_parallel > 1:
        dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
        rank = parallel_state.get_tensor_model_parallel_rank()
        block = shape[dim] // stride
        expert_block[dim] *= tensor_parallel
        blocks = []
        for index in range(stride):
            local_offsets, global_offsets, sizes = [0] * ndim, [0] * ndim, list(shape)
            local_offsets[dim] = index * block
            global_offsets[dim] = (index * tensor_parallel + rank) * block
            sizes[dim] = block
            blocks.append(Block(tuple(local_offsets), tuple(global_offsets), tuple(sizes)))
    global_shape = list(expert_block)
    expert_parallel = parallel_state.get_expert_model_parallel_world_size()
    if is_expert_parameter(param) and expert_parallel > 1:
        first = parallel_state.get_expert_model_parallel_rank() * expert_block[0]
        global_shape[0] *= expert_parallel
        blocks = [
            Block(b.local_offsets, (b.global_offsets[0] + first, *b.global_offsets[1:]), b.sizes)
            for b in blocks
        ]
    return torch.Size(global_shape), blocks


def is_replicated_over_tensor_parallel(param: torch.Tensor) -> bool:
    """Whether every tensor-parallel rank holds the same `param` (norms, row-parallel biases,
    position embeddings): only tensor-parallel rank 0 then writes it."""
    return not (
        getattr(param, "tensor_model_parallel", False)
        and parallel_state.get_tensor_model_parallel_world_size() > 1
    )


def chunks_like(param: torch.Tensor, tensor: torch.Tensor) -> ChunkedTensor:
    """`tensor` (shaped and split like `param`) as chunks of its single-process tensor. A
    DTensor (FSDP2) holds rows [first, first + n) of this tensor-parallel rank's tensor: each
    block's part of those rows."""
    global_shape, blocks = tensor_blocks(param)
    scalar = tensor.dim() == 0
    first = 0 if scalar else local_offsets(tensor)[0]
    local = local_part(tensor).detach()
    chunks = []
    for block in blocks:
        starts, offsets, sizes = block.local_offsets, block.global_offsets, block.sizes
        if not scalar:
            begin = max(starts[0], first)
            end = min(starts[0] + sizes[0], first + local.shape[0])
            if begin >= end:
                continue  # none of this block's rows is on this rank
            offsets = (offsets[0] + begin - starts[0], *offsets[1:])
            starts, sizes = (begin - first, *starts[1:]), (end - begin, *sizes[1:])
        view = local
        for dim, (start, size) in enumerate(zip(starts, sizes)):
            if size != local.shape[dim]:
                view = view.narrow(dim, start, size)
        chunks.append((offsets, view))
    return ChunkedTensor(global_shape, chunks)


def flat_range_chunks(param: torch.Tensor, flat: torch.Tensor, start: int) -> ChunkedTensor:
    """`flat`, elements [start, start + flat.numel()) of `param.view(-1)` (a distributed-
    optimizer shard's state of `param`), as chunks of the single-process tensor."""
    global_shape, blocks = tensor_blocks(param)
    shape = tuple(param.shape)
    strides = _contiguous_strides(shape)
    flat = flat.detach()
    chunks = []
    for offsets, sizes in flat_range_rectangles(shape, start, start + flat.numel()):
        for block in blocks:
            overlap = _intersect(offsets, sizes, block.local_offsets, block.sizes)
            if overlap is None:
                continue
            local_offsets, overlap_sizes = overlap
            first = sum(o * s for o, s in zip(local_offsets, strides)) - start
            view = flat.as_strided(overlap_sizes, strides, flat.storage_offset() + first)
            global_offsets = tuple(
                g + o - b
                for g, o, b in zip(block.global_offsets, local_offsets, block.local_offsets)
            )
            chunks.append((global_offsets, view))
    return ChunkedTensor(global_shape, chunks)


def flat_range_rectangles(
    shape: Sequence[int], start: int, end: int
) -> List[Tuple[Offsets, Offsets]]:
    """Elements [start, end) of a row-major tensor of `shape` as (offsets, sizes) rectangles,
    in order, each contiguous in memory: at most 2 * len(shape) - 1 of them."""
    shape = tuple(shape)
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first_whole, end_whole = -(-start // inner), end // inner
    if first_whole > end_whole:  # inside one row
        row = start // inner
        return _in_row(
            row, flat_range_rectangles(shape[1:], start - row * inner, end - row * inner)
        )
    rectangles = []
    if start < first_whole * inner:
        row = first_whole - 1
        rectangles += _in_row(row, flat_range_rectangles(shape[1:], start - row * inner, inner))
    if first_whole < end_whole:
        rectangles.append(
            ((first_whole,) + (0,) * (len(shape) - 1), (end_whole - first_whole, *shape[1:]))
        )
    if end_whole * inner < end:
        rectangles += _in_row(
            end_whole, flat_range_rectangles(shape[1:], 0, end - end_whole * inner)
        )
    return rectangles


def _in_row(row: int, rectangles: List[Tuple[Offsets, Offsets]]) -> List[Tuple[Offsets, Offsets]]:
    return [((row, *offsets), (1, *sizes)) for offsets, sizes in rectangles]


def _contiguous_strides(shape: Sequence[int]) -> Tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _intersect(
    offsets_a: Offsets, sizes_a: Offsets, offsets_b: Offsets, sizes_b: Offsets
) -> Optional[Tuple[Offsets, Offsets]]:
    starts = [max(a, b) for a, b in zip(offsets_a, offsets_b)]
    ends = [min(a + n, b + m) for a, n, b, m in zip(offsets_a, sizes_a, offsets_b, sizes_b)]
    if any(s >= e for s, e in zip(starts, ends)):
        return None
    return tuple(starts), tuple(e - s for s, e in zip(starts, ends))
