"""Megatron-LM's on-disk layout, and the fsync/rename steps that make writing it crash-safe.

{root}/latest_checkpointed_iteration.txt       "<iteration>" or "release"; written last
{root}/iter_{iteration:07d}/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt
{root}/iter_{iteration:07d}.tmp-{pid}/...      a save in progress (or cut off): never loaded
"""

from __future__ import annotations

import os
from typing import Union

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
CHECKPOINT_FILENAME = "model_optim_rng.pt"
RELEASE = "release"
TEMPORARY_MARKER = ".tmp-"

Iteration = Union[int, str]  # an iteration number, or RELEASE


class CheckpointError(RuntimeError):
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
        raise CheckpointError(
            f"checkpoint tracker {path} holds {content!r}, not an iteration number or "
            f"{RELEASE!r}; write the iteration of a complete checkpoint under {root} into it, "
            "or remove it to start from scratch"
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
