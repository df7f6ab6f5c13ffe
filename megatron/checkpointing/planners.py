"""torch.distributed.checkpoint planners that write and read `ChunkedTensor`s.

DCP's default planners take a state dict of plain tensors, DTensors or ShardedTensors; a rank
of this framework holds its shards as plain tensors whose place in the single-process tensor
the parameters' attributes describe (megatron.checkpointing.chunks), and a distributed-
optimizer shard is several rectangles of one tensor, which a DTensor cannot express. These
planners hand DCP that description directly: one SHARD write item per chunk (DCP checks that
the chunks of all ranks tile each tensor, and writes a chunk several ranks hold once), and
read items for whatever stored chunks overlap each chunk to load, copied straight into it.
"""

from __future__ import annotations

import ctypes
from typing import Any, Dict, List, Optional

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron.checkpointing.chunks import ChunkedTensor


class ChunkSavePlanner(DefaultSavePlanner):
    """Writes `tensors` ({global name: ChunkedTensor}); DCP's state dict argument is unused."""

    def __init__(self, tensors: Dict[str, ChunkedTensor], progress: Optional[Any] = None) -> None:
        super().__init__(flatten_state_dict=False)
        self.tensors = tensors
        self._by_index: Dict[MetadataIndex, torch.Tensor] = {}
        # A progress bar (megatron.checkpointing.progress) counting the bytes handed to DCP's
        # writer, tensor by tensor; the offline tools pass one.
        self.progress = progress

    def create_local_plan(self) -> SavePlan:
        items: List[WriteItem] = []
        for name, chunked in self.tensors.items():
            for offsets, tensor in chunked.chunks:
                index = MetadataIndex(name, torch.Size(offsets))
                self._by_index[index] = tensor
                items.append(
                    WriteItem(
                        index=index,
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(
                                offsets=torch.Size(offsets), sizes=tensor.size()
                            ),
                            properties=TensorProperties.create_from_tensor(tensor),
                            size=chunked.global_shape,
                        ),
                    )
                )
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        tensor = self._by_index[write_item.index]
        if self.progress is not None:
            self.progress.update(tensor.numel() * tensor.element_size())
        return _own_storage_view(tensor)


def _own_storage_view(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or for a contiguous CPU view of a larger storage (a shard of the distributed
    optimizer's flat buffers) an alias whose storage is exactly its bytes: DCP's writer copies
    a tensor that is part of a larger storage, and those copies are what a save would hold
    in memory beyond the rank's own state."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0:
        return tensor
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.untyped_storage().nbytes() == nbytes:
        return tensor
    memory = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    alias = torch.frombuffer(memory, dtype=tensor.dtype).view(tensor.shape)
    alias._aliased = tensor  # keeps the memory alive as long as the alias
    return alias


class ChunkLoadPlanner(DefaultLoadPlanner):
    """Reads the stored tensors into `tensors` ({global name: ChunkedTensor}), whose chunk
    tensors are the destinations (views of what the rank holds)."""

    def __init__(self, tensors: Dict[str, ChunkedTensor]) -> None:
        super().__init__(flatten_state_dict=False)
        self.tensors = tensors

    def create_local_plan(self) -> LoadPlan:
        requests: List[ReadItem] = []
        for name, chunked in self.tensors.items():
            wanted = [
                ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.size())
                for offsets, tensor in chunked.chunks
            ]
            requests += create_read_items_for_chunk_list(
                name, self.metadata.state_dict_metadata[name], wanted
            )
        return LoadPlan(requests)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        # dest_index.index is the chunk's position in the list create_local_plan passed.
        _, tensor = self.tensors[read_item.dest_index.fqn].chunks[read_item.dest_index.index]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            tensor = tensor.narrow(dim, start, length)
        return tensor

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Nothing to do: `resolve_tensor` gave the destination itself, which DCP filled."""
