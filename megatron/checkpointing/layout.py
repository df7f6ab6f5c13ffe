"""Megatron-LM's on-disk layout, and the fsync/rename steps that make writing it crash-safe.

{root}/latest_checkpointed_iteration.txt       "<iteration>" or "release"; written last
{root}/iter_{iteration:07d}/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt
{root}/iter_{iteration:07d}/checksums.json     digests of the files above (checksums)
{root}/iter_{iteration:07d}/metadata.json, common.pt, .metadata, __<rank>_<n>.distcp
                                               instead, in the torch_dist format (torch_dist)
{root}/iter_{iteration:07d}.tmp-{pid}/...      a save in progress (or cut off): never loaded
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from typing import List, Optional, Union

from megatron.checkpointing.checksums import CHECKSUMS_FILENAME
from megatron.errors import UserError

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
CHECKPOINT_FILENAME = "model_optim_rng.pt"
RELEASE = "release"
TEMPORARY_MARKER = ".tmp-"
# A torch_dist checkpoint's marker (Megatron-Core's) and DCP's index of its tensors.
SHARDED_MARKER_FILENAME = "metadata.json"
DCP_INDEX_FILENAME = ".metadata"

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
    checkpoints without checksums (older saves, Megatron-LM's), a model_optim_rng.pt file or
    a torch_dist checkpoint's marker and index."""
    if os.path.isfile(os.path.join(iteration_directory, CHECKSUMS_FILENAME)):
        return True
    try:
        names = os.listdir(iteration_directory)
    except OSError:
        return False
    if {SHARDED_MARKER_FILENAME, DCP_INDEX_FILENAME} <= set(names):
        return True  # a torch_dist checkpoint saved without checksums: DCP's index is last
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


def prepare_temporary_directory(root: str, iteration: int) -> str:
    """The empty temporary directory (named for this process) a save of `iteration` fills;
    left over ones of earlier failed saves of it are removed."""
    os.makedirs(root, exist_ok=True)
    temporary_root = os.path.join(root, temporary_directory_name(iteration))
    replaced = os.path.join(root, temporary_directory_name(iteration, ".replaced"))
    for stale in (temporary_root, replaced):
        if os.path.exists(stale):
            shutil.rmtree(stale)
    os.makedirs(temporary_root)
    return temporary_root


def move_into_place(
    root: str, iteration: int, temporary_root: str, keep_latest: Optional[int] = None
) -> None:
    """Rename the complete `temporary_root` to iter_XXXXXXX, point the tracker at it, and
    clean up (keeping only the newest `keep_latest` checkpoints when given).

    The tracker names another iteration meanwhile; a failure removes the temporary directory
    and puts back a directory it was replacing.
    """
    final_directory = os.path.join(root, iteration_directory_name(iteration))
    replaced = os.path.join(root, temporary_directory_name(iteration, ".replaced"))
    moved_aside = False
    try:
        if os.path.exists(final_directory):
            if read_tracker(root) == iteration:
                # Moving it aside would leave the tracker naming a missing directory.
                raise CheckpointError(
                    f"refusing to replace {final_directory}: the tracker names it"
                )
            # A directory cannot be renamed over a non-empty one: move the old one aside under
            # a temporary name (never loaded, cleaned up below), then move the new one in.
            os.replace(final_directory, replaced)
            moved_aside = True
        os.replace(temporary_root, final_directory)
        moved_aside = False
        fsync_directory(root)
    except BaseException:
        shutil.rmtree(temporary_root, ignore_errors=True)
        if moved_aside and not os.path.exists(final_directory):
            os.replace(replaced, final_directory)
        raise
    write_tracker(root, iteration)
    if keep_latest:
        remove_older_checkpoints(root, keep_latest)
    remove_leftovers(root)


def remove_older_checkpoints(root: str, keep_latest: int) -> List[int]:
    """Delete all but the newest `keep_latest` complete checkpoints under `root` (the tracker
    names the newest); returns the iterations deleted. Each is first renamed to a temporary
    name, so one cut off while being deleted is never taken for a complete checkpoint."""
    deleted = []
    tracked = read_tracker(root)
    if not isinstance(tracked, int):
        return []
    # Iterations above the tracker's (a run resumed from an older checkpoint) are left alone.
    older = [iteration for iteration in complete_iterations(root) if iteration <= tracked]
    for iteration in older[:-keep_latest]:
        directory = os.path.join(root, iteration_directory_name(iteration))
        doomed = os.path.join(root, temporary_directory_name(iteration, ".deleted"))
        try:
            os.replace(directory, doomed)
        except OSError:  # the new checkpoint is complete whatever happens to an old one
            continue
        shutil.rmtree(doomed, ignore_errors=True)
        deleted.append(iteration)
    if deleted:
        fsync_directory(root)
    return deleted


def remove_leftovers(root: str) -> None:
    """Delete temporaries of saves that were cut off (or replaced) now that one succeeded."""
    for path in leftover_temporaries(root):
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except OSError:
                pass


def save_failure_message(root: str, iteration: int, exc: BaseException) -> str:
    """One line: what failed (the errno's meaning and the file, or an interrupt), and what is
    still on disk."""
    advice = f"resume with --load {root}"
    if isinstance(exc, KeyboardInterrupt):
        what = "was interrupted (Ctrl-C)"
    elif isinstance(exc, OSError) and exc.errno is not None:
        symbol = errno.errorcode.get(exc.errno, f"errno {exc.errno}")
        what = f"failed: {os.strerror(exc.errno)} ({symbol})"
        if exc.filename:
            what += f" writing {exc.filename}"
        advice = f"free space under {root} (or fix the I/O error) and {advice}"
    else:
        what = f"failed: {exc!r}"
    try:
        latest = read_tracker(root)
    except CheckpointError:
        latest = None
    kept = (
        f"the latest checkpoint is still iteration {latest}"
        if latest is not None
        else "no earlier checkpoint is there"
    )
    return (
        f"saving iteration {iteration} under {root} {what}; its partial files were removed "
        f"and {kept}; {advice}"
    )


def earlier_checkpoint_advice(root: str, iteration: Iteration) -> str:
    """What to do about a checkpoint that cannot be loaded: resume from the one before it."""
    tracker = tracker_file(root)
    previous = (
        newest_complete_iteration(root, below=iteration) if isinstance(iteration, int) else None
    )
    if previous is None:
        return (
            f"there is no earlier checkpoint under {root}: remove {tracker} (and the "
            "checkpoint it names) to start from scratch"
        )
    return (
        f"point {tracker} at the previous checkpoint, iteration {previous}: "
        f"echo {previous} > {tracker}"
    )


def refuse_missing_checkpoint(root: str, iteration: Iteration, path: str) -> None:
    """Raise CheckpointError when the checkpoint the tracker names is not there to load: its
    directory is gone, or it is a torch_dist checkpoint that lost its marker file, or the
    torch format's file `path` is missing. The message names what is missing."""
    directory = os.path.join(root, iteration_directory_name(iteration))
    advice = earlier_checkpoint_advice(root, iteration)
    interrupted = [p for p in leftover_temporaries(root, iteration) if os.path.isdir(p)]
    hint = f"; interrupted saves of this iteration remain in {interrupted}" if interrupted else ""
    if not os.path.isdir(directory):
        raise CheckpointError(
            f"the tracker names iteration {iteration}, but its directory {directory} does not "
            f"exist{hint}; {advice}"
        )
    if os.path.isfile(os.path.join(directory, SHARDED_MARKER_FILENAME)) or os.path.isfile(path):
        return
    names = sorted(os.listdir(directory))
    sharded = [n for n in names if n in (DCP_INDEX_FILENAME, "common.pt") or n.endswith(".distcp")]
    if sharded:
        raise CheckpointError(
            f"{directory} is a torch_dist checkpoint (it holds {', '.join(sharded)}) whose "
            f"{SHARDED_MARKER_FILENAME} is missing; {advice}"
        )
    raise CheckpointError(
        f"the tracker names iteration {iteration}, but checkpoint file {path} does not "
        f"exist{hint}; {advice}"
    )


def resume_advice(root: Optional[str]) -> str:
    """Where a stopped run resumes: the checkpoint the tracker under `root` (--save) names."""
    if not root:
        return "this run saves no checkpoints (no --save): it starts again from the beginning"
    try:
        iteration = read_tracker(root)
    except CheckpointError as error:
        return str(error)
    if iteration is None:
        return f"no checkpoint under {root} yet: the job starts again from the beginning"
    directory = os.path.join(root, iteration_directory_name(iteration))
    return (
        f"the latest checkpoint is {directory}: restart the job (torchrun --max-restarts does) "
        "to resume there"
    )
