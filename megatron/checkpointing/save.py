"""Write a checkpoint atomically: a temporary directory renamed into place, the tracker last.

The tracker only ever names a complete directory: a save never touches the iteration the
tracker names (that state is already on disk), and any other directory it replaces is moved
aside only after the new one is complete.
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron import parallel_state
from megatron.checkpointing.checksums import (
    BLOCK_SIZE,
    ChecksumWriter,
    FileChecksum,
    hashing_threads,
    write_manifest,
)
from megatron.checkpointing.full_state import full_model_state_dict, full_optimizer_state_dict
from megatron.checkpointing.layout import (
    CheckpointError,
    checkpoint_file,
    fsync_directory,
    is_complete,
    iteration_directory_name,
    leftover_temporaries,
    read_tracker,
    shard_file,
    temporary_directory_name,
    write_tracker,
)
from megatron.checkpointing.pipeline_state import (
    pipeline_full_model_state_dict,
    pipeline_full_optimizer_state_dict,
)
from megatron.checkpointing.rng import data_parallel_rank, gather_rng_states
from megatron.initialize import broadcast_from, print_rank_0

CHECKPOINT_VERSION = 3.0

# Wrappers whose `.module` holds the model; matched by name as well so that a local
# data-parallel wrapper named like Megatron's (DistributedDataParallel, Float16Module)
# unwraps without this module importing it.
WRAPPER_CLASS_NAMES = ("DistributedDataParallel", "Float16Module")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model under any data-parallel / precision wrappers, whose keys the checkpoint holds."""
    while isinstance(model, nn.parallel.DistributedDataParallel) or (
        type(model).__name__ in WRAPPER_CLASS_NAMES and isinstance(model.module, nn.Module)
    ):
        model = model.module
    return model


def is_pipeline_parallel() -> bool:
    """Whether the model is split into pipeline stages (an nn.ModuleList of chunks)."""
    return parallel_state.get_pipeline_model_parallel_world_size() > 1


def save_checkpoint(
    config: Any,
    iteration: int,
    model: nn.Module,
    optimizer: Any = None,
    scheduler: Any = None,
    args: argparse.Namespace | None = None,
    *,
    consumed_train_samples: int = 0,
    consumed_valid_samples: int = 0,
    data_parallel_group: dist.ProcessGroup | None = None,
    print_fn: Callable[[str], None] = print_rank_0,
    checksums: bool = True,
) -> str | None:
    """Save `iteration` under `config.save` (a CheckpointConfig); called on every rank.

    `args` is the run's argument namespace, saved (a copy, with the consumed sample counts) as
    Megatron does. Every rank contributes its RNG state; data-parallel rank 0 writes, recording
    the file's checksums (megatron.checkpointing.checksums; `checksums=False` is for measuring
    their cost). `--no-save-optim` leaves out optimizer and scheduler state, `--no-save-rng`
    the RNG states. Returns the file written on the writing rank, None elsewhere and when the
    tracker already names `iteration` (its state is on disk; it is not written again). Raises
    CheckpointError on every rank when the write failed.
    """
    if not config.save:
        raise CheckpointError("save_checkpoint called without --save; pass --save DIR")
    writes = data_parallel_rank(data_parallel_group) == 0
    if _from_writer(writes and _already_saved(config.save, iteration), data_parallel_group):
        print_fn(
            f"iteration {iteration} is already saved under {config.save} (the tracker names "
            "it); not saved again"
        )
        return None
    rng_states = None if config.no_save_rng else gather_rng_states(data_parallel_group)
    optimizer_state = None
    # The writer's tensor- and expert-parallel peers gather their shards with it, so the file
    # holds the full tensors of a single-process run (full_state). They are the ranks of
    # expert-data-parallel rank 0 (without expert parallelism: data-parallel rank 0).
    in_writing_replica = parallel_state.get_expert_data_parallel_rank() == 0
    # Under pipeline parallelism the stages' tensors are gathered to the first stage too.
    pipeline = is_pipeline_parallel()
    model_state = None
    if in_writing_replica:
        model = unwrap_model(model)
        if pipeline:
            model_state = pipeline_full_model_state_dict(model)
        else:
            model_state = full_model_state_dict(model)
    if optimizer is not None and not config.no_save_optim:
        unsharded_view = getattr(optimizer, "unsharded_view", None)
        if unsharded_view is not None:
            # The distributed optimizer first gathers its data-parallel shards (a collective on
            # every rank) into the state a MegatronOptimizer of this rank holds; that state then
            # goes through the same tensor-, expert- and pipeline-parallel gathering, so one
            # checkpoint loads in any layout, sharded or not.
            optimizer = unsharded_view(gather=True)
        if in_writing_replica and pipeline:
            optimizer_state = pipeline_full_optimizer_state_dict(optimizer, model, model_state)
        elif in_writing_replica:
            optimizer_state = full_optimizer_state_dict(optimizer)
    error, cause, path = None, None, None
    if writes:
        try:
            state = _checkpoint_state(
                iteration,
                model_state,
                optimizer_state,
                None if config.no_save_optim else scheduler,
                rng_states,
                args,
                consumed_train_samples,
                consumed_valid_samples,
            )
            path = _write_atomically(config.save, iteration, state, checksums)
        except Exception as exc:  # reported on every rank below, so none waits forever
            error, cause = _failure_message(config.save, iteration, exc), exc
    # The final barrier: every rank leaves once the writer has finished, knowing its outcome.
    error = _from_writer(error, data_parallel_group)
    if error is not None:
        raise CheckpointError(error) from cause
    print_fn(f"saved checkpoint at iteration {iteration:7d} to {config.save}")
    return path


def _from_writer(value: Any, data_parallel_group: dist.ProcessGroup | None) -> Any:
    """The writing rank's `value` on every rank of the group (a collective when distributed)."""
    if data_parallel_group is None or not dist.is_initialized():
        return broadcast_from(value)
    return broadcast_from(
        value, src=dist.get_global_rank(data_parallel_group, 0), group=data_parallel_group
    )


def _already_saved(root: str, iteration: int) -> bool:
    """Whether the tracker names `iteration` and its directory is complete: a run relaunched
    after its last save, whose state is that checkpoint's."""
    try:
        named = read_tracker(root)
    except CheckpointError:
        return False
    return named == iteration and is_complete(
        os.path.join(root, iteration_directory_name(iteration))
    )


def _failure_message(root: str, iteration: int, exc: BaseException) -> str:
    """One line: what failed (the errno's meaning and the file), and what is still on disk."""
    if isinstance(exc, OSError) and exc.errno is not None:
        symbol = errno.errorcode.get(exc.errno, f"errno {exc.errno}")
        what = f"{os.strerror(exc.errno)} ({symbol})"
        if exc.filename:
            what += f" writing {exc.filename}"
    else:
        what = repr(exc)
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
        f"saving iteration {iteration} under {root} failed: {what}; its partial files were "
        f"removed and {kept}; free space under {root} (or fix the I/O error) and resume with "
        f"--load {root}"
    )


def _checkpoint_state(
    iteration: int,
    model_state: Dict[str, torch.Tensor],
    optimizer_state: Dict[str, Any] | None,
    scheduler: Any,
    rng_states: List[Dict[str, Any]] | None,
    args: argparse.Namespace | None,
    consumed_train_samples: int,
    consumed_valid_samples: int,
) -> Dict[str, Any]:
    # A copy, so the caller's namespace is not changed; Megatron keeps the consumed sample
    # counts in args, and tools reading its checkpoints look for them there.
    saved_args = argparse.Namespace(**vars(args)) if args is not None else argparse.Namespace()
    saved_args.consumed_train_samples = consumed_train_samples
    saved_args.consumed_valid_samples = consumed_valid_samples
    state: Dict[str, Any] = {
        "args": saved_args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "consumed_train_samples": consumed_train_samples,
        "consumed_valid_samples": consumed_valid_samples,
        "model": model_state,
    }
    if optimizer_state is not None:
        state["optimizer"] = optimizer_state
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    if rng_states is not None:
        state["rng_state"] = rng_states
    return state


def _write_atomically(root: str, iteration: int, state: Dict[str, Any], checksums: bool) -> str:
    """Write into a temporary directory, rename it to iter_XXXXXXX, then move the tracker.

    A crash before the tracker is replaced leaves it naming the previous complete checkpoint;
    a failure removes the temporary directory and puts back a directory it was replacing.
    """
    os.makedirs(root, exist_ok=True)
    final_directory = os.path.join(root, iteration_directory_name(iteration))
    temporary_root = os.path.join(root, temporary_directory_name(iteration))
    replaced = os.path.join(root, temporary_directory_name(iteration, ".replaced"))
    moved_aside = False
    try:
        for stale in (temporary_root, replaced):  # left by an earlier failed save
            if os.path.exists(stale):
                shutil.rmtree(stale)
        _write_directory(temporary_root, state, checksums)
        if os.path.exists(final_directory):
            if read_tracker(root) == iteration:
                # Moving it aside would leave the tracker naming a missing directory.
                raise CheckpointError(
                    f"refusing to replace {final_directory}: the tracker names it"
                )
            # A directory cannot be renamed over a non-empty one: move the old one aside under
            # a temporary name (never loaded, cleaned up below), then move the new one in. The
            # tracker names another iteration meanwhile.
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
    _remove_leftovers(root)
    return checkpoint_file(root, iteration)


def _write_directory(directory: str, state: Dict[str, Any], checksums: bool) -> None:
    """The checkpoint file and its checksums in `directory`, synced to disk."""
    path = shard_file(directory)
    os.makedirs(os.path.dirname(path))
    record: Optional[FileChecksum] = None
    try:
        with open(path, "wb") as file:
            if checksums:
                with ThreadPoolExecutor(hashing_threads()) as pool:
                    writer = ChecksumWriter(file, pool)
                    try:
                        torch.save(state, writer)
                    except Exception:
                        # torch.save reports a failed write as its own RuntimeError.
                        if writer.error is not None:
                            raise writer.error from None
                        raise
                    record = writer.finish()
            else:
                torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
    except OSError as error:
        if error.errno is None or error.filename:
            raise
        raise OSError(error.errno, error.strerror, path) from error
    if record is not None:
        write_manifest(directory, {os.path.relpath(path, directory): record}, BLOCK_SIZE)
    fsync_directory(os.path.dirname(path))
    fsync_directory(directory)


def _remove_leftovers(root: str) -> None:
    """Delete temporaries of saves that were cut off (or replaced) now that one succeeded."""
    for path in leftover_temporaries(root):
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except OSError:
                pass
