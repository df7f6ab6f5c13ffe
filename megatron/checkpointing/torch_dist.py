"""The files of a `--ckpt-format torch_dist` checkpoint: every rank writes its own chunks.

    iter_0000100/metadata.json     {"sharded_backend": "torch_dist", ...} (Megatron-Core's marker)
    iter_0000100/common.pt         what is not a sharded tensor: args, iteration, consumed
                                   samples, scheduler, every rank's RNG state, the optimizer's
                                   hyper-parameters and loss scaler (global rank 0 writes it)
    iter_0000100/.metadata         DCP's index: each tensor's global shape and stored chunks
    iter_0000100/__<rank>_<n>.distcp   the chunks rank <rank> wrote
    iter_0000100/checksums.json    every file's digests, each hashed by the rank that wrote it

Tensors are named and split as megatron.checkpointing.sharded_state describes; DCP (through
megatron.checkpointing.planners) stores each chunk once, and reads back whichever stored
chunks overlap what a rank of any layout holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata

from megatron.checkpointing.checksums import FileChecksum, file_checksum
from megatron.checkpointing.chunks import ChunkedTensor
from megatron.checkpointing.layout import DCP_INDEX_FILENAME, SHARDED_MARKER_FILENAME
from megatron.checkpointing.planners import ChunkLoadPlanner, ChunkSavePlanner

FORMAT = "torch_dist"
METADATA_FILENAME = SHARDED_MARKER_FILENAME
COMMON_FILENAME = "common.pt"
DCP_METADATA_FILENAME = DCP_INDEX_FILENAME
# One writer thread per rank: DCP's extra writer threads drop their exceptions (a failed write
# would go unreported and its chunks missing from the index), while the calling thread's
# reach every rank.
WRITER_THREADS = 1


def is_sharded_checkpoint(iteration_directory: str) -> bool:
    """Whether `iteration_directory` holds a torch_dist checkpoint."""
    return os.path.isfile(os.path.join(iteration_directory, METADATA_FILENAME))


def rank_and_size(group: Optional[dist.ProcessGroup]) -> tuple:
    """(rank, size) in `group`; (0, 1) without torch.distributed (one process)."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def write_sharded_files(
    directory: str,
    tensors: Dict[str, ChunkedTensor],
    common: Optional[Dict[str, Any]],
    group: Optional[dist.ProcessGroup],
    checksums: bool = True,
    progress: Optional[Any] = None,
) -> Dict[str, FileChecksum]:
    """Write this rank's chunks (and on rank 0 `common` and the markers) into `directory`;
    collective over `group`. Returns the checksums of the files this rank wrote, by name
    relative to `directory` (empty with `checksums=False`). `progress`: a bar counting the
    chunks' bytes as they are written (megatron.checkpointing.progress)."""
    rank, size = rank_and_size(group)
    # DCP first: it reports a failure on any rank to every rank, so all leave it together.
    with _single_process_quietly():
        dcp.save(
            {},
            storage_writer=FileSystemWriter(directory, thread_count=WRITER_THREADS),
            planner=ChunkSavePlanner(tensors, progress),
            process_group=group,
        )
    # DCP names rank r's files __r_<n>.distcp; any it names otherwise rank 0 hashes. Every
    # rank's files are complete once dcp.save returned (it ends with a collective).
    files = sorted(name for name in os.listdir(directory) if name.endswith(".distcp"))
    prefixes = [f"__{other}_" for other in range(size)]
    written = [name for name in files if name.startswith(prefixes[rank])]
    if rank == 0:
        written.append(DCP_METADATA_FILENAME)
        written += [name for name in files if not name.startswith(tuple(prefixes))]
        written += _write_common(directory, common)
    if not checksums:
        return {}
    return {name: file_checksum(os.path.join(directory, name)) for name in written}


def _write_common(directory: str, common: Dict[str, Any]) -> List[str]:
    """`common.pt` and Megatron-Core's `metadata.json`, synced; their names."""
    with open(os.path.join(directory, COMMON_FILENAME), "wb") as file:
        torch.save(common, file)
        file.flush()
        os.fsync(file.fileno())
    with open(os.path.join(directory, METADATA_FILENAME), "w") as file:
        json.dump(
            {
                "sharded_backend": FORMAT,
                "sharded_backend_version": 1,
                "common_backend": "torch",
                "common_backend_version": 1,
            },
            file,
        )
        file.flush()
        os.fsync(file.fileno())
    return [COMMON_FILENAME, METADATA_FILENAME]


@contextlib.contextmanager
def _single_process_quietly() -> Iterator[None]:
    """DCP warns that it assumes a single process when torch.distributed is not initialized,
    which is what a one-process run (and the format converter) means; and torch 2.4's writer
    calls its own deprecated `TypedStorage` API, a warning about torch, not about the run, that
    would come before the one line a failed save prints."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        yield


def read_common(directory: str) -> Dict[str, Any]:
    """`common.pt`. weights_only=False: it holds an argparse.Namespace and python/numpy RNG
    states, which the weights-only unpickler refuses; only load checkpoints you trust."""
    return torch.load(
        os.path.join(directory, COMMON_FILENAME), map_location="cpu", weights_only=False
    )


def read_tensor_metadata(directory: str) -> Metadata:
    """DCP's index of the stored tensors (global shapes, dtypes, chunks)."""
    return FileSystemReader(directory).read_metadata()


def read_sharded_tensors(
    directory: str, tensors: Dict[str, ChunkedTensor], group: Optional[dist.ProcessGroup]
) -> None:
    """Fill each chunk of `tensors` from the stored tensor of its name; collective over
    `group` (every rank passes what it needs, possibly nothing)."""
    with _single_process_quietly():
        dcp.load(
            {},
            storage_reader=FileSystemReader(directory),
            planner=ChunkLoadPlanner(tensors),
            process_group=group,
        )
