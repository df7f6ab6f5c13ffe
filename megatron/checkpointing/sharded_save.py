"""Saving `--ckpt-format torch_dist`: every rank writes its own chunks, in parallel.

The steps, each a collective over the checkpoint group (megatron.parallel.parallel_state), so that they
can run in the training thread or, for `--async-save`, in a background one:

1. global rank 0 makes the temporary directory (megatron.checkpointing.layout) and names it;
2. every rank writes its chunks into it through DCP and hashes the files it wrote;
3. rank 0 gathers the checksums, writes `checksums.json`, renames the directory into place and
   moves the tracker; a failure anywhere removes the temporary directory, and every rank gets
   the same outcome.

Nothing here gathers a tensor: a rank's chunks are views of its own parameters and optimizer
state (megatron.checkpointing.sharded_state).
"""

from __future__ import annotations

import shutil
from typing import Any, Dict, List, Optional

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from megatron.checkpointing.checksums import BLOCK_SIZE, FileChecksum, write_manifest
from megatron.checkpointing.chunks import ChunkedTensor
from megatron.checkpointing.layout import (
    fsync_directory,
    move_into_place,
    prepare_temporary_directory,
    save_failure_message,
)
from megatron.checkpointing.sharded_state import (
    inner_optimizer,
    model_tensors_to_save,
    optimizer_tensors_to_save,
)
from megatron.checkpointing.torch_dist import FORMAT, rank_and_size, write_sharded_files
from megatron.initialize import broadcast_from


def sharded_tensors(model: nn.Module, optimizer: Any) -> Dict[str, ChunkedTensor]:
    """This rank's chunks of the model and (when given) the optimizer state: views."""
    tensors = model_tensors_to_save(model)
    if optimizer is not None:
        tensors.update(optimizer_tensors_to_save(optimizer, model))
    return tensors


def optimizer_common_state(optimizer: Any) -> Dict[str, Any]:
    """What of the optimizer is not per-parameter: its hyper-parameters and loss scaler."""
    common: Dict[str, Any] = {
        "param_groups": [
            {key: value for key, value in group.items() if key != "params"}
            for group in inner_optimizer(optimizer).param_groups
        ]
    }
    grad_scaler = getattr(optimizer, "grad_scaler", None)
    if grad_scaler is not None:
        common["grad_scaler"] = grad_scaler.state_dict()
    return common


def common_state(state: Dict[str, Any]) -> Dict[str, Any]:
    """`common.pt`'s content: a torch-format checkpoint's state without the tensors."""
    common = {key: value for key, value in state.items() if key not in ("model", "optimizer")}
    return {**common, "ckpt_format": FORMAT}


def write_sharded_checkpoint(
    root: str,
    iteration: int,
    tensors: Dict[str, ChunkedTensor],
    common: Optional[Dict[str, Any]],
    group: Optional[dist.ProcessGroup],
    checksums: bool = True,
    keep_latest: Optional[int] = None,
    progress: Optional[Any] = None,
) -> Optional[str]:
    """Write iteration `iteration` under `root` (steps in the module docstring); `common` is
    needed on global rank 0 only. Returns None, or on every rank the one-line message of a
    failure (the previous checkpoint stays the latest). `progress`: a bar counting the bytes
    written (the offline tools' megatron.checkpointing.progress)."""
    rank, _ = rank_and_size(group)
    temporary, error = None, None
    if rank == 0:
        try:
            temporary = prepare_temporary_directory(root, iteration)
        except (Exception, KeyboardInterrupt) as exc:
            error = save_failure_message(root, iteration, exc)
    temporary, error = broadcast_from((temporary, error), group=group)
    if error is not None:
        return error
    records: Dict[str, FileChecksum] = {}
    try:
        records = write_sharded_files(
            temporary, tensors, common if rank == 0 else None, group, checksums, progress
        )
    except (Exception, KeyboardInterrupt, CheckpointException) as exc:  # every rank reports
        error = save_failure_message(root, iteration, first_failure(exc))
    gathered = _gather_to_first((records, error), group)
    if rank == 0:
        errors = [rank_error for _, rank_error in gathered if rank_error is not None]
        error = errors[0] if errors else None
        try:
            if error is None:
                if checksums:
                    merged = {
                        name: record
                        for rank_records, _ in gathered
                        for name, record in rank_records.items()
                    }
                    write_manifest(temporary, merged, BLOCK_SIZE)
                fsync_directory(temporary)
                move_into_place(root, iteration, temporary, keep_latest)
        except (Exception, KeyboardInterrupt) as exc:
            error = save_failure_message(root, iteration, exc)
        if error is not None:
            shutil.rmtree(temporary, ignore_errors=True)
    return broadcast_from(error, group=group)


def first_failure(error: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException (which lists every
    rank's, with tracebacks, on many lines)."""
    failures = getattr(error, "failures", None)
    if not failures:
        return error
    first = failures[min(failures)]
    return first[0] if isinstance(first, tuple) else first


def _gather_to_first(value: Any, group: Optional[dist.ProcessGroup]) -> List[Any]:
    """Every rank's `value` on global rank 0 (in rank order); [] elsewhere."""
    if not dist.is_initialized():
        return [value]
    is_first = dist.get_rank(group) == 0
    gathered: Optional[List[Any]] = [None] * dist.get_world_size(group) if is_first else None
    dist.gather_object(value, gathered, dst=0, group=group)
    return gathered if is_first else []
