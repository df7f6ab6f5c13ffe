"""Write a checkpoint atomically: a temporary directory renamed into place, the tracker last.

The tracker only ever names a complete directory: a save never touches the iteration the
tracker names (that state is already on disk), and any other directory it replaces is moved
aside only after the new one is complete.
"""

from __future__ import annotations

import argparse
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron.checkpointing.async_save import AsyncCheckpointWriter
from megatron.checkpointing.checksums import (
    BLOCK_SIZE,
    CHECKSUMS_FILENAME,
    ChecksumWriter,
    FileChecksum,
    hashing_threads,
    write_manifest,
)
from megatron.checkpointing.chunks import ChunkedTensor
from megatron.checkpointing.full_state import full_model_state_dict, full_optimizer_state_dict
from megatron.checkpointing.layout import (
    CheckpointError,
    checkpoint_file,
    fsync_directory,
    is_complete,
    iteration_directory_name,
    move_into_place,
    prepare_temporary_directory,
    read_tracker,
    save_failure_message,
    shard_file,
)
from megatron.checkpointing.pipeline_state import (
    pipeline_full_model_state_dict,
    pipeline_full_optimizer_state_dict,
)
from megatron.checkpointing.rng import data_parallel_rank, gather_rng_states
from megatron.checkpointing.sharded_save import (
    common_state,
    optimizer_common_state,
    sharded_tensors,
    write_sharded_checkpoint,
)
from megatron.checkpointing.torch_dist import FORMAT
from megatron.initialize import broadcast_from, print_rank_0
from megatron.optimizer.optimizer import MegatronOptimizer
from megatron.parallel import parallel_state
from megatron.pipeline.stages import holds_stage_chunks

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


def is_pipeline_parallel(model: nn.Module) -> bool:
    """Whether `model` (maybe in DDP) is split into pipeline stages: this rank's chunks."""
    return holds_stage_chunks(unwrap_model(model))


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
    async_writer: AsyncCheckpointWriter | None = None,
) -> str | None:
    """Save `iteration` under `config.save` (a CheckpointConfig); called on every rank.

    `args` is the run's argument namespace, saved (a copy, with the consumed sample counts) as
    Megatron does. Every rank contributes its RNG state; data-parallel rank 0 writes, recording
    the file's checksums (megatron.checkpointing.checksums; `checksums=False` is for measuring
    their cost). `--no-save-optim` leaves out optimizer and scheduler state, `--no-save-rng`
    the RNG states. Returns the file written on the writing rank, None elsewhere and when the
    tracker already names `iteration` (its state is on disk; it is not written again). Raises
    CheckpointError on every rank when the write failed.

    `config.ckpt_format` "torch_dist" instead has every rank write its own chunks
    (megatron.checkpointing.sharded_save) and returns None; with `async_writer` the write goes
    on in the background once the state is copied to host memory (its failure is raised by
    the next save or `async_writer.wait()`).
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
    if config.ckpt_format == FORMAT:
        _save_sharded(
            config,
            iteration,
            unwrap_model(model),
            None if config.no_save_optim else optimizer,
            _checkpoint_state(
                iteration,
                None,
                None,
                None if config.no_save_optim else scheduler,
                rng_states,
                args,
                consumed_train_samples,
                consumed_valid_samples,
            ),
            print_fn,
            checksums,
            async_writer,
        )
        return None
    optimizer_state = None
    # The writer's tensor- and expert-parallel peers gather their shards with it, so the file
    # holds the full tensors of a single-process run (full_state). They are the ranks of
    # expert-data-parallel rank 0 (without expert parallelism: data-parallel rank 0).
    in_writing_replica = parallel_state.get_expert_data_parallel_rank() == 0
    # Under pipeline parallelism the stages' tensors are gathered to the first stage too.
    pipeline = is_pipeline_parallel(model)
    model_state = None
    if in_writing_replica:
        model = unwrap_model(model)
        if pipeline:
            model_state = pipeline_full_model_state_dict(model)
        else:
            model_state = full_model_state_dict(model)
    if optimizer is not None and not config.no_save_optim:
        if isinstance(optimizer, MegatronOptimizer):
            # The distributed optimizer first gathers its data-parallel shards (a collective on
            # every rank) into the state a MegatronOptimizer of this rank holds; that state then
            # goes through the same tensor-, expert- and pipeline-parallel gathering, so one
            # checkpoint loads in any layout, sharded or not.
            optimizer = optimizer.unsharded_view(gather=True)
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
            path = write_torch_checkpoint(
                config.save, iteration, state, checksums, config.keep_latest_checkpoints
            )
        # Reported on every rank below, so none waits forever; Ctrl-C too, as an interrupt.
        except (Exception, KeyboardInterrupt) as exc:
            error, cause = save_failure_message(config.save, iteration, exc), exc
    # The final barrier: every rank leaves once the writer has finished, knowing its outcome.
    error = _from_writer(error, data_parallel_group)
    if error is not None:
        raise CheckpointError(error) from cause
    print_fn(f"saved checkpoint at iteration {iteration:7d} to {config.save}")
    return path


def _save_sharded(
    config: Any,
    iteration: int,
    model: nn.Module,
    optimizer: Any,
    state: Dict[str, Any],
    print_fn: Callable[[str], None],
    checksums: bool,
    async_writer: AsyncCheckpointWriter | None,
) -> None:
    """The torch_dist save of `state` (a torch-format state without the tensors) and the
    chunks of `model` and `optimizer` (None: not saved)."""
    if optimizer is not None:
        state["optimizer_common"] = optimizer_common_state(optimizer)
    common = common_state(state)
    tensors = sharded_tensors(model, optimizer)
    group = parallel_state.get_checkpoint_group()
    keep_latest = config.keep_latest_checkpoints

    def write(tensors: Dict[str, ChunkedTensor]) -> Optional[str]:
        return write_sharded_checkpoint(
            config.save, iteration, tensors, common, group, checksums, keep_latest
        )

    done = f"saved checkpoint at iteration {iteration:7d} to {config.save}"
    if async_writer is None:
        error = write(tensors)
        if error is not None:
            raise CheckpointError(error)
        print_fn(done)
        return
    async_writer.wait(print_fn)  # the host buffers are reused: the last write must be done
    staged = async_writer.stage(tensors, print_fn)
    async_writer.start(lambda: write(staged), done)
    print_fn(
        f"checkpoint at iteration {iteration:7d} copied to host memory; writing it to "
        f"{config.save} in the background"
    )


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
        # Says the directory had a checksums.json, so that a load which finds none knows it
        # was lost rather than never written.
        "checksums": CHECKSUMS_FILENAME,
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


def write_torch_checkpoint(
    root: str,
    iteration: int,
    state: Dict[str, Any],
    checksums: bool = True,
    keep_latest: Optional[int] = None,
    progress: Optional[Any] = None,
) -> str:
    """Write a torch-format `state` (one model_optim_rng.pt) into a temporary directory, rename
    it to iter_XXXXXXX, then move the tracker; returns the file's path. `progress`: a bar
    counting the bytes torch.save writes (the offline tools' megatron.checkpointing.progress).

    A crash before the tracker is replaced leaves it naming the previous complete checkpoint;
    a failure removes the temporary directory and puts back a directory it was replacing.
    """
    temporary_root = prepare_temporary_directory(root, iteration)
    try:
        _write_directory(temporary_root, state, checksums, progress)
    except BaseException:
        shutil.rmtree(temporary_root, ignore_errors=True)
        raise
    move_into_place(root, iteration, temporary_root, keep_latest)
    return checkpoint_file(root, iteration)


class _CountedFile:
    """A binary file whose writes also advance `progress` by their bytes."""

    def __init__(self, file: BinaryIO, progress: Any) -> None:
        self._file, self._progress = file, progress

    def write(self, data) -> int:
        written = self._file.write(data)
        self._progress.update(memoryview(data).nbytes)
        return written

    def flush(self) -> None:
        self._file.flush()

    def fileno(self) -> int:
        return self._file.fileno()


def _write_directory(
    directory: str, state: Dict[str, Any], checksums: bool, progress: Optional[Any] = None
) -> None:
    """The checkpoint file and its checksums in `directory`, synced to disk."""
    path = shard_file(directory)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    record: Optional[FileChecksum] = None
    try:
        with open(path, "wb") as raw_file:
            file = raw_file if progress is None else _CountedFile(raw_file, progress)
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
