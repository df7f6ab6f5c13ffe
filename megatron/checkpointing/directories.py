"""Start-up checks of --load and --save, before any data is built or any step is taken.

A run that would start from scratch beside checkpoints it cannot see (a lost tracker, a
mistyped --load) would go on to overwrite them; a --save directory that cannot be created,
written or hold one checkpoint would fail at the first save, after hours of training. Both
stop here with one line saying what to do.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from megatron.checkpointing.layout import (
    RELEASE,
    CheckpointError,
    complete_iterations,
    iteration_directory_name,
    read_tracker,
    refuse_untracked_checkpoints,
)
from megatron.initialize import broadcast_from, is_global_rank_zero, print_rank_0
from megatron.parallel.expert_parameters import is_expert_parameter


def estimate_checkpoint_bytes(
    parameters: Iterable[torch.nn.Parameter],
    optimizer: str,
    sgd_momentum: float,
    save_optimizer: bool,
    data_parallel_size: int,
    expert_data_parallel_size: int,
    device: torch.device,
) -> int:
    """Bytes of one checkpoint of the whole model: its fp32 weights and, unless --no-save-optim,
    the optimizer's per-parameter state (Adam: two moments; SGD: the momentum, if any).

    `parameters` are this rank's; the shares of all ranks are added up on `device` (a
    collective when distributed): a replica's parameters are counted once per data-parallel
    replica, expert shards once per expert-data-parallel replica. Tensors that tensor-parallel
    ranks both hold are counted by each, so the estimate errs a little high.
    """
    dense, expert = 0, 0
    for parameter in parameters:
        size = parameter.numel() * 4  # checkpoints hold fp32 weights (the master weights)
        if is_expert_parameter(parameter):
            expert += size
        else:
            dense += size
    # On the run's device: NCCL reduces device tensors only.
    totals = torch.tensor([dense, expert], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(totals)
    weights = totals[0].item() / data_parallel_size + totals[1].item() / expert_data_parallel_size
    states = 0 if not save_optimizer else 2 if optimizer == "adam" else int(sgd_momentum > 0)
    return int(weights * (1 + states))


def check_checkpoint_directories(
    config: Any,
    estimated_bytes: int,
    print_fn: Callable[[str], None] = print_rank_0,
    final_iteration: Optional[int] = None,
) -> None:
    """Refuse a run whose checkpoints would be lost or could not be written; called on every
    rank (global rank 0 looks at the file systems and tells the others).

    `config` is a CheckpointConfig. --load: a directory with complete checkpoints but no
    tracker is refused. --save: created if missing; refused when it is not a writable
    directory, when its file system has less free space than `estimated_bytes` (one more
    checkpoint; the size of its newest one when it has one), and when it holds checkpoints
    this run does not resume from, which it would overwrite. A run that resumes --save at or
    past `final_iteration` (its --train-iters) saves nothing more, so it needs no free space.
    """
    outcome = None
    if is_global_rank_zero():
        try:
            outcome = ("notes", _check(config, estimated_bytes, final_iteration))
        except CheckpointError as error:
            outcome = ("error", str(error))
    kind, value = broadcast_from(outcome)
    if kind == "error":
        raise CheckpointError(value)
    for note in value:
        print_fn(note)


def _check(config: Any, estimated_bytes: int, final_iteration: Optional[int]) -> list:
    notes = []
    if config.load and os.path.isdir(config.load) and read_tracker(config.load) is None:
        refuse_untracked_checkpoints(config.load)
    if not config.save:
        return notes
    save = config.save
    _make_writable_directory(save)
    saved = complete_iterations(save)
    if saved:
        tracked = read_tracker(save)  # raises, naming the newest complete one, when unreadable
        if tracked is None:
            refuse_untracked_checkpoints(save)
        if not _resumes_from(config, tracked):
            start = (
                "starts from scratch"
                if not config.load
                else f"loads --load {config.load}{' with --finetune' if config.finetune else ''}"
            )
            raise CheckpointError(
                f"--save {save} holds the checkpoints of another run (its tracker names "
                f"iteration {tracked}), which this run would overwrite: it {start}; to resume "
                f"that run pass --load {save}, or give --save a directory without checkpoints"
            )
        newer = [iteration for iteration in saved if iteration > tracked]
        if newer:
            notes.append(
                f"note: {save} holds checkpoints newer than the tracker's iteration {tracked} "
                f"({', '.join(map(str, newer))}); this run replaces them as it reaches them"
            )
        if final_iteration is not None and isinstance(tracked, int) and tracked >= final_iteration:
            return notes  # a finished run relaunched: nothing left to save
    needed = _newest_checkpoint_bytes(save, saved) or estimated_bytes
    free = shutil.disk_usage(save).free
    if free < needed:
        raise CheckpointError(
            f"--save {save}: its file system has {_gigabytes(free)} free, but one checkpoint "
            f"of this run needs about {_gigabytes(needed)}; free some space or choose another "
            "--save directory"
        )
    return notes


def _make_writable_directory(path: str) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"--save {path} is a file, not a directory; give a directory")
    try:
        os.makedirs(path, exist_ok=True)
        descriptor, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)
        os.close(descriptor)
        os.remove(probe)
    except OSError as error:
        raise CheckpointError(
            f"--save {path} cannot be written: {error.strerror or error}; give a directory "
            "this user can create and write"
        ) from None


def _resumes_from(config: Any, tracked: Optional[Any]) -> bool:
    """Whether the run continues the checkpoints under --save: it loads the same directory's
    tracked iteration with its optimizer state and iteration count."""
    return (
        bool(config.load)
        and os.path.realpath(config.load) == os.path.realpath(config.save)
        and not config.finetune
        and tracked not in (None, RELEASE)
    )


def _newest_checkpoint_bytes(root: str, iterations: list) -> Optional[int]:
    """The size of the newest complete checkpoint's files, the best estimate of the next one."""
    if not iterations:
        return None
    directory = os.path.join(root, iteration_directory_name(iterations[-1]))
    total = 0
    for parent, _, names in os.walk(directory):
        total += sum(os.path.getsize(os.path.join(parent, name)) for name in names)
    return total or None


def _gigabytes(size: int) -> str:
    return f"{size / 1e9:.2f} GB"
