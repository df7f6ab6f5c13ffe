"""Megatron-Core's --record-memory-history and --memory-snapshot-path: the CUDA caching
allocator records every allocation and free (with its stack) from before the model is built, and
the last rank writes a snapshot of that history at every log line, each replacing the one before,
so the file holds the run up to its latest log line. Open it at https://pytorch.org/memory_viz.

As in Megatron-Core: the recording starts where its model_provider starts it, the snapshot is the
last rank's (under a pipeline, the stage with the loss and the logits), and it is dumped where
training_log dumps it. The flags are refused without a GPU (megatron.config.validation).
"""

from __future__ import annotations

import os
import pickle

import torch

from megatron.config import LoggingConfig
from megatron.initialize import DistributedContext

# Megatron-Core's trace_alloc_max_entries: the alloc/free events kept before the snapshot.
MAX_ENTRIES = 100_000


def start_memory_history(config: LoggingConfig) -> None:
    """Start recording the allocator's history on this rank, when --record-memory-history."""
    if config.record_memory_history:
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)


def dump_memory_snapshot(config: LoggingConfig, context: DistributedContext) -> None:
    """Write the history so far to --memory-snapshot-path, on the last rank only. Written under
    a temporary name and renamed, so that a reader never sees half of one."""
    if not config.record_memory_history or context.rank != context.world_size - 1:
        return
    path = config.memory_snapshot_path
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temporary = f"{path}.tmp"
    with open(temporary, "wb") as handle:
        pickle.dump(torch.cuda.memory._snapshot(), handle)
    os.replace(temporary, path)
