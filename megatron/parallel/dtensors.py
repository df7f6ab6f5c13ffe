"""What the rest of the project asks of a DTensor: the parameters, gradients and optimizer
state of an FSDP2 run (megatron.parallelize.fully_shard) are DTensor shards of the whole
tensors over the data-parallel ranks. Everything else in a run holds plain tensors, and on a
torch without public DTensors (before 2.5; FSDP2 is refused there) nothing is one."""

from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch 2.4: no public DTensor, and no run that makes one
    DTensor = None


def is_dtensor(tensor: torch.Tensor) -> bool:
    return DTensor is not None and isinstance(tensor, DTensor)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` this rank holds (a view): itself unless it is a DTensor."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def shard_groups(tensor: torch.Tensor) -> Tuple[dist.ProcessGroup, ...]:
    """The groups whose ranks hold different parts of `tensor`: none for a plain tensor; for a
    DTensor its mesh's groups along which it is sharded, not those it is replicated over
    (hybrid sharding)."""
    if not is_dtensor(tensor):
        return ()
    mesh = tensor.device_mesh
    return tuple(
        mesh.get_group(dim) for dim, place in enumerate(tensor.placements) if place.is_shard()
    )


def local_offsets(tensor: torch.Tensor) -> Tuple[int, ...]:
    """Where this rank's part of `tensor` starts in the whole tensor (zeros unless it is a
    DTensor)."""
    if not is_dtensor(tensor):
        return (0,) * tensor.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    return tuple(offsets)
