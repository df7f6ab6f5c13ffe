"""Megatron-LM's on-disk layout, and the fsync/rename steps that make writing it crash-safe.

{root}/latest_checkpointed_iteration.txt       "<iteration>" or "release"; written last
{root}/iter_{iteration:07d}/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt
{root}/iter_{iteration:07d}/checksums.json     digests of the files above (checksums)
{root}/iter_{iteration:07d}.tmp-{pid}/...      a save in progress (or cut off): never loaded
"""

from __future__ import annotations

import os
import re
from typing import List, Optional, Union

from megatron.checkpointing.checksums import CHECKSUMS_FILENAME
from megatron.errors import UserError

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
CHECKPOINT_FILENAME = "model_optim_rng.pt"
RELEASE = "release"
TEMPORARY_MARKER = ".tmp-"

Iteration = Union[int, str]  # an iteration number, or RELEASE

_ITERATION_DIRECTORY = re.compile(r"iter_(\d{7,})")
_SHARD_DIRECTORY = re.compile(r"mp_rank_\d{2}(_\d{3})?")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be read or written as asked; the message says which file."""


def iteration_directory_name(iteration: Iteration) -> str:
    """`iter_0000100` for iteration 100, `release` for a release checkpoint."""
    return RELEASE if iteration == RELEASE else f"iter_{int(iteration):07d}"


def model_parallel_directory_name(tp_rank: int = 0, pp_rank: int = 0, pp_size: int = 1) -> str:
    """Megatron's per-shard directory: mp_rank_{tp:02d}, with _{pp:03d} when pipelined."""
    if pp_size > 1:
        return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return f"mp_rank_{tp_rank:02d}"


def checkpoint_file(
    root: str, iteration: Iteration, tp_rank: int = 0, pp_rank: int = 0, pp_size: int = 1
) -> str:
    """Path of one shard's model_optim_rng.pt under checkpoint directory `root`."""
    iteration_directory = os.path.join(root, iteration_directory_name(iteration))
    return shard_file(iteration_directory, tp_rank, pp_rank, pp_size)


def shard_file(
    iteration_directory: str, tp_rank: int = 0, pp_rank: int = 0, pp_size: int = 1
) -> str:
    """Path of one shard's model_optim_rng.pt inside an iteration's directory."""
    return os.path.join(
        iteration_directory,
        model_parallel_directory_name(tp_rank, pp_rank, pp_size),
        CHECKPOINT_FILENAME,
    )


def tracker_file(root: str) -> str:
    """Path of the file naming the latest complete checkpoint under `root`."""
    return os.path.join(root, TRACKER_FILENAME)


def read_tracker(root: str) -> Iteration | None:
    """The iteration (int) or RELEASE the tracker names; None when there is no tracker file."""
    path = tracker_file(root)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        content = f.read().strip()
    if content == RELEASE:
        return RELEASE
    try:
        iteration = int(content)
    except ValueError:
        iteration = -1
    if iteration < 0:
        newest = newest_complete_iteration(root)
        fix = (
            f"the newest complete one is {newest}: echo {newest} > {path}"
            if newest is not None
            else f"there is none under {root}: remove {path} to start from scratch"
        )
        raise CheckpointError(
            f"checkpoint tracker {path} holds {content!r}, not an iteration number or "
            f"{RELEASE!r}; write the iteration of a complete checkpoint into it ({fix})"
        )
    return iteration


def write_tracker(root: str, iteration: Iteration) -> None:
    """Point the tracker at `iteration` atomically: a reader sees the old or the new content."""
    path = tracker_file(root)
    temporary = f"{path}{TEMPORARY_MARKER}{os.getpid()}"
    with open(temporary, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    fsync_directory(root)


def fsync_directory(path: str) -> None:
    """Make entries created or renamed in directory `path` durable (a no-op where unsupported)."""
    if os.name == "nt":  # directories cannot be opened for fsync on Windows
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_directory_name(iteration: Iteration, suffix: str = "") -> str:
    """A per-process name beside `iter_XXXXXXX` that loading never reads."""
    return f"{iteration_directory_name(iteration)}{TEMPORARY_MARKER}{os.getpid()}{suffix}"


def leftover_temporaries(root: str, iteration: Iteration | None = None) -> list[str]:
    """Paths of saves cut off under `root` (for `iteration` only, when given)."""
    prefix = "" if iteration is None else iteration_directory_name(iteration)
    if not os.path.isdir(root):
        return []
    return sorted(
        os.path.join(root, name)
        for name in os.listdir(root)
        if TEMPORARY_MARKER in name and name.startswith(prefix)
    )


def is_complete(iteration_directory: str) -> bool:
    """Whether an iteration's directory holds a whole checkpoint: one this project saved (its
    checksums are written last, before the directory is renamed into place), or, for
    checkpoints without checksums (older saves, Megatron-LM's), a model_optim_rng.pt file."""
    if os.path.isfile(os.path.join(iteration_directory, CHECKSUMS_FILENAME)):
        return True
    try:
        names = os.listdir(iteration_directory)
    except OSError:
        return False
    return any(
        _SHARD_DIRECTORY.fullmatch(name)
        and os.path.isfile(os.path.join(iteration_directory, name, CHECKPOINT_FILENAME))
        for name in names
    )


def complete_iterations(root: str) -> List[int]:
    """Iterations (ascending) with a complete checkpoint directory under `root`."""
    if not os.path.isdir(root):
        return []
    iterations = []
    for name in os.listdir(root):
        match = _ITERATION_DIRECTORY.fullmatch(name)
        if match and is_complete(os.path.join(root, name)):
            iterations.append(int(match.group(1)))
    return sorted(iterations)


def newest_complete_iteration(root: str, below: Optional[int] = None) -> Optional[int]:
    """The newest complete iteration under `root` (older than `below` when given), or None."""
    candidates = [
        iteration for iteration in complete_iterations(root) if below is None or iteration < below
    ]
    return candidates[-1] if candidates else None


def refuse_untracked_checkpoints(root: str) -> None:
    """Raise CheckpointError when `root` holds complete checkpoints but the caller found no
    tracker: starting from scratch there (a lost tracker, or a mistyped directory standing in
    for another) would go on to overwrite them."""
    newest = newest_complete_iteration(root)
    if newest is not None:
        tracker = tracker_file(root)
        raise CheckpointError(
            f"{root} holds complete checkpoints (the newest is iteration {newest}) but no "
            f"tracker file {tracker}; to resume from the newest: echo {newest} > {tracker}; "
            "to start from scratch, use a directory without checkpoints for --save and --load"
        )
