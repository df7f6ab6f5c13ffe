"""Resume from the checkpoint the tracker names, with Megatron's --no-load-*/--finetune rules."""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from megatron.checkpointing.checksums import (
    CHECKSUMS_FILENAME,
    ManifestError,
    find_damage,
    read_manifest,
)
from megatron.checkpointing.chunks import ChunkedTensor
from megatron.checkpointing.finite import refuse_non_finite_load, unverified_note
from megatron.checkpointing.full_state import (
    load_full_model_state_dict,
    load_full_optimizer_state_dict,
)
from megatron.checkpointing.layout import (
    RELEASE,
    CheckpointError,
    Iteration,
    checkpoint_file,
    earlier_checkpoint_advice,
    iteration_directory_name,
    read_tracker,
    refuse_missing_checkpoint,
    refuse_untracked_checkpoints,
    tracker_file,
)
from megatron.checkpointing.model_arguments import MODEL_ARGUMENTS, model_argument_differences
from megatron.checkpointing.pipeline_state import (
    load_pipeline_model_state_dict,
    load_pipeline_optimizer_state_dict,
)
from megatron.checkpointing.rng import (
    data_parallel_rank,
    missing_rng_state,
    restore_rng_state,
    saved_rng_state_index,
)
from megatron.checkpointing.save import is_pipeline_parallel, unwrap_model
from megatron.checkpointing.sharded_load import (
    load_inner_optimizer_state,
    verify_sharded_checkpoint,
)
from megatron.checkpointing.sharded_save import first_failure
from megatron.checkpointing.sharded_state import (
    MODEL_PREFIX,
    inner_optimizer,
    model_tensors_to_load,
    optimizer_state_to_load,
)
from megatron.checkpointing.torch_dist import (
    is_sharded_checkpoint,
    read_common,
    read_sharded_tensors,
    read_tensor_metadata,
)
from megatron.initialize import (
    broadcast_from,
    first_from_any_rank,
    is_global_rank_zero,
    print_rank_0,
)
from megatron.optimizer.optimizer import MegatronOptimizer
from megatron.parallel import parallel_state
from megatron.pipeline.stages import stage_to_full_names
from megatron.tensor_parallel import MODEL_PARALLEL_RNG


@dataclass(frozen=True)
class LoadedState:
    """Where training resumes; `loaded_from` is the file read, None when starting from scratch."""

    iteration: int
    consumed_train_samples: int
    consumed_valid_samples: int
    loaded_from: str | None


def load_checkpoint(
    config: Any,
    model: nn.Module,
    optimizer: Any = None,
    scheduler: Any = None,
    *,
    data_parallel_group: dist.ProcessGroup | None = None,
    print_fn: Callable[[str], None] = print_rank_0,
    args: argparse.Namespace | None = None,
    model_arguments: Sequence[str] = MODEL_ARGUMENTS,
) -> LoadedState:
    """Load the checkpoint named by `{config.load}/latest_checkpointed_iteration.txt`.

    `config` is a CheckpointConfig (or anything with its fields). Without --load, or with a
    --load directory that holds no checkpoint at all, training starts from scratch (iteration
    0); a directory with complete checkpoints but no tracker is refused, naming the newest.
    The file's checksums are verified first (on global rank 0; a collective when
    distributed). --no-load-optim skips optimizer and scheduler state, --no-load-rng the RNG
    states; --finetune and release checkpoints load only the model weights and restart at
    iteration 0 with no consumed samples. `args` (this run's namespace) is compared with the
    saved one over `model_arguments`: the differences explain weights that do not fit, and
    are a warning when they do.
    """
    if not config.load:
        print_fn("no --load given: training from scratch (iteration 0)")
        return LoadedState(0, 0, 0, None)
    iteration = read_tracker(config.load)
    if iteration is None:
        refuse_untracked_checkpoints(config.load)
        print_fn(
            f"WARNING: could not find the tracker file {tracker_file(config.load)}; "
            "training from scratch (iteration 0)"
        )
        return LoadedState(0, 0, 0, None)
    directory = os.path.join(config.load, iteration_directory_name(iteration))
    if is_sharded_checkpoint(directory):
        checkpoint: _TorchCheckpoint | _ShardedCheckpoint = _ShardedCheckpoint(
            config.load, iteration, directory, print_fn
        )
    else:
        checkpoint = _TorchCheckpoint(config.load, iteration, print_fn)
    path, state = checkpoint.path, checkpoint.state
    differences = (
        model_argument_differences(state.get("args"), args, model_arguments)
        if args is not None
        else []
    )

    model_only = bool(config.finetune) or iteration == RELEASE
    conversion = None
    checkpoint.load_model(unwrap_model(model), differences)
    if differences:
        print_fn(
            f"WARNING: {path} was saved with other model flags than this run's (its weights "
            f"fit, but the model computes differently): {'; '.join(differences)}"
        )
    if not model_only and not config.no_load_optim:
        if optimizer is not None:
            checkpoint.load_optimizer(optimizer, unwrap_model(model))
            conversion = getattr(inner_optimizer(optimizer), "loaded_state_conversion", None)
        if scheduler is not None:
            scheduler_state = _required(state, "opt_param_scheduler", path, "--no-load-optim")
            try:
                scheduler.load_state_dict(scheduler_state)
            except ValueError as error:
                raise CheckpointError(f"{path}: {error}") from None
    if not checkpoint.verified:
        print_fn(unverified_note(checkpoint, "its tensors checked for NaN and inf"))
        tensors = list(unwrap_model(model).named_parameters())
        refuse_non_finite_load(tensors, optimizer, checkpoint.directory, config.load, iteration)
    if not model_only and not config.no_load_rng:
        rng_states = _required(state, "rng_state", path, "--no-load-rng")
        index, seeded_streams = saved_rng_state_index(
            rng_states, data_parallel_rank(data_parallel_group)
        )
        # Refused on every rank when one has no state: a rank that went on would report the
        # load and then wait in its next collective for the rank that stopped.
        refused = first_from_any_rank(missing_rng_state(rng_states, index, path))
        if refused is not None:
            raise CheckpointError(refused[1])
        restore_rng_state(rng_states, index, path, keep_seeded=seeded_streams)
        if seeded_streams:
            # Only a changed TP size leaves the model-parallel stream as seeded.
            changed = "tensor" if MODEL_PARALLEL_RNG in seeded_streams else "expert"
            print_fn(
                f"note: {path} was saved at another {changed}-parallel size; the default RNG "
                f"streams resume, the tracker's {', '.join(seeded_streams)} stream(s) start "
                "from the seed"
            )

    if model_only:
        loaded = LoadedState(0, 0, 0, path)
    else:
        loaded = LoadedState(
            iteration=int(state["iteration"]),
            consumed_train_samples=_consumed(state, "consumed_train_samples"),
            consumed_valid_samples=_consumed(state, "consumed_valid_samples"),
            loaded_from=path,
        )
    converted = f" (optimizer state converted: {conversion})" if conversion else ""
    print_fn(f"loaded checkpoint {path} at iteration {iteration}{converted}")
    return loaded


class _TorchCheckpoint:
    """`--ckpt-format torch`: one model_optim_rng.pt with the single-process tensors. It and
    `_ShardedCheckpoint` offer `path` (the name in messages), `state` (everything but the
    tensors' values; all of it here), `load_model` and `load_optimizer`."""

    def __init__(self, root: str, iteration: Iteration, print_fn: Callable[[str], None]):
        self.path = checkpoint_file(root, iteration)
        self.directory = os.path.join(root, iteration_directory_name(iteration))
        self.state, self.verified = _read_verified(root, iteration, self.path, print_fn)

    def load_model(self, model: nn.Module, differences: List[str]) -> None:
        _load_model_state(model, self.state["model"], self.path, differences)

    def load_optimizer(self, optimizer: Any, model: nn.Module) -> None:
        optimizer_state = _required(self.state, "optimizer", self.path, "--no-load-optim")
        # Checkpoints hold the unsharded state: a rank takes its stage's, tensor-parallel and
        # expert shards' part, and the distributed optimizer its data-parallel shard of that.
        if isinstance(optimizer, MegatronOptimizer):
            optimizer = optimizer.unsharded_view(gather=False)
        if is_pipeline_parallel(model):
            load_pipeline_optimizer_state_dict(
                optimizer, model, optimizer_state, self.state["model"]
            )
        else:
            load_full_optimizer_state_dict(optimizer, optimizer_state)


class _ShardedCheckpoint:
    """`--ckpt-format torch_dist`: each rank reads the chunks it holds (sharded_state)."""

    def __init__(
        self, root: str, iteration: Iteration, directory: str, print_fn: Callable[[str], None]
    ):
        self.path = directory
        self.advice = earlier_checkpoint_advice(root, iteration)
        self.group = parallel_state.get_checkpoint_group()
        self.directory = directory
        self.verified = verify_sharded_checkpoint(root, iteration, directory, self.group, print_fn)
        try:
            self.state = read_common(directory)
            self.stored = read_tensor_metadata(directory).state_dict_metadata
        except Exception as exc:
            raise CheckpointError(
                f"could not read checkpoint {directory} ({exc!r}); "
                f"{earlier_checkpoint_advice(root, iteration)}"
            ) from exc

    def load_model(self, model: nn.Module, differences: List[str]) -> None:
        targets = model_tensors_to_load(model)
        stored = {name for name in self.stored if name.startswith(MODEL_PREFIX)}
        missing = sorted(name[len(MODEL_PREFIX) :] for name in targets.keys() - stored)
        unexpected = (
            []
            if is_pipeline_parallel(model)
            else sorted(name[len(MODEL_PREFIX) :] for name in stored - targets.keys())
        )
        if missing or unexpected:
            raise CheckpointError(
                _misfit_message(self.path, differences, _key_summary(missing, unexpected))
            )
        for name, chunked in targets.items():
            saved_shape = tuple(self.stored[name].size)
            if saved_shape != tuple(chunked.global_shape):
                detail = (
                    f"size mismatch for {name[len(MODEL_PREFIX) :]}: the checkpoint holds shape "
                    f"{saved_shape}, this model's is {tuple(chunked.global_shape)}"
                )
                raise CheckpointError(_misfit_message(self.path, differences, detail))
        self._read(targets)

    def load_optimizer(self, optimizer: Any, model: nn.Module) -> None:
        common = _required(self.state, "optimizer_common", self.path, "--no-load-optim")
        state, targets = optimizer_state_to_load(optimizer, model, self.stored)
        self._read(targets)
        load_inner_optimizer_state(optimizer, state, common)

    def _read(self, targets: Dict[str, ChunkedTensor]) -> None:
        try:
            read_sharded_tensors(self.path, targets, self.group)
        except (Exception, CheckpointException) as exc:
            raise CheckpointError(
                f"could not read checkpoint {self.path} ({first_failure(exc)!r}); {self.advice}"
            ) from None


def _read_verified(
    root: str, iteration: Iteration, path: str, print_fn: Callable[[str], None]
) -> Tuple[Dict[str, Any], bool]:
    """The checkpoint file's contents, once its checksums match those recorded at save, and
    whether there were checksums to match.

    Global rank 0 verifies the file (a pass over its bytes on a pool of threads) while every
    rank reads it, so the two share the disk reads; nothing read is used before the outcome,
    which rank 0 then tells every rank (a collective). A damaged file raises CheckpointError
    on every rank, ahead of whatever reading it raised.
    """
    with ThreadPoolExecutor(1) as verifier:
        outcome = (
            verifier.submit(_checksum_outcome, root, iteration, path)
            if is_global_rank_zero()
            else None
        )
        state, read_error = None, None
        try:
            state = _read_checkpoint_file(root, iteration, path)
        except CheckpointError as error:
            read_error = error
        outcome = outcome.result() if outcome is not None else None
    outcome = broadcast_from(outcome)
    verified = True
    if outcome is not None:
        damaged, message = outcome
        if damaged:
            raise CheckpointError(message)
        if message is None:
            verified = False
        else:
            print_fn(message)
    if read_error is not None:
        raise read_error
    return state, verified


def _checksum_outcome(
    root: str, iteration: Iteration, path: str
) -> Optional[Tuple[bool, Optional[str]]]:
    """(damaged, message), the message None when there are no checksums; or None when there is
    no file to check (reported when reading)."""
    if not os.path.isfile(path):
        return None
    directory = os.path.join(root, iteration_directory_name(iteration))
    try:
        manifest = read_manifest(directory)
    except ManifestError as error:
        return True, (
            f"{error}, so {path} cannot be verified; {earlier_checkpoint_advice(root, iteration)}"
            f" (or delete {CHECKSUMS_FILENAME} to load the file unverified)"
        )
    if manifest is None:
        return False, None  # said by load_checkpoint, which knows what the state records
    name = os.path.relpath(path, directory)
    expected = manifest.files.get(name)
    if expected is None:
        return True, (
            f"{manifest.path} records no checksum of {name}, so it cannot be verified; "
            f"{earlier_checkpoint_advice(root, iteration)}"
        )
    start = time.perf_counter()
    damage = find_damage(path, expected, manifest.block_size)
    seconds = time.perf_counter() - start
    if damage is not None:
        return True, (
            f"checkpoint file {path} is damaged: {damage} (checksums in {manifest.path}); "
            f"{earlier_checkpoint_advice(root, iteration)}"
        )
    return False, (
        f"verified the checksums of {path} ({expected.size / 1e9:.2f} GB) in {seconds:.1f} s"
    )


def read_torch_checkpoint(
    root: str, iteration: Iteration, print_fn: Callable[[str], None] = print_rank_0
) -> Dict[str, Any]:
    """The whole state of a --ckpt-format torch checkpoint, its checksums verified."""
    checkpoint = _TorchCheckpoint(root, iteration, print_fn)
    if not checkpoint.verified:
        print_fn(unverified_note(checkpoint, "its tensors are not checked"))
    return checkpoint.state


def read_checkpoint_args(load_dir: str) -> argparse.Namespace | None:
    """The arguments saved with the latest checkpoint under `load_dir`; None without a tracker."""
    iteration = read_tracker(load_dir)
    if iteration is None:
        return None
    directory = os.path.join(load_dir, iteration_directory_name(iteration))
    if is_sharded_checkpoint(directory):
        return read_common(directory).get("args")
    path = checkpoint_file(load_dir, iteration)
    return _read_checkpoint_file(load_dir, iteration, path).get("args")


def _read_checkpoint_file(root: str, iteration: Iteration, path: str) -> Dict[str, Any]:
    advice = earlier_checkpoint_advice(root, iteration)
    refuse_missing_checkpoint(root, iteration, path)
    try:
        # map_location="cpu": a checkpoint saved on GPUs loads on any machine, and tensors
        # move to the model's device through load_state_dict. weights_only=False: the file
        # holds an argparse.Namespace and python/numpy RNG states, which the weights-only
        # unpickler refuses; only load checkpoints you trust.
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"could not read checkpoint file {path} ({exc!r}); {advice}") from exc
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path} is not a Megatron model_optim_rng.pt checkpoint; {advice}")
    return state


def _load_model_state(
    model: nn.Module, model_state: Dict[str, Any], path: str, differences: List[str]
) -> None:
    pipeline = is_pipeline_parallel(model)
    if pipeline:
        # This rank's stages, under single-process names; the other stages' keys are theirs.
        expected = {
            name for chunk in model for name in stage_to_full_names(chunk.state_dict(), chunk)
        }
    else:
        expected = set(model.state_dict().keys())
    missing = sorted(expected - model_state.keys())
    unexpected = [] if pipeline else sorted(model_state.keys() - expected)
    if missing or unexpected:
        raise CheckpointError(_misfit_message(path, differences, _key_summary(missing, unexpected)))
    try:
        if pipeline:
            load_pipeline_model_state_dict(model, model_state)
        else:
            load_full_model_state_dict(model, model_state)
    except RuntimeError as exc:
        raise CheckpointError(_misfit_message(path, differences, _shape_summary(exc))) from None


def _misfit_message(path: str, differences: List[str], detail: str) -> str:
    if differences:
        return (
            f"the model in {path} does not fit this run's: {'; '.join(differences)}; run with "
            "the checkpoint's values of these flags"
        )
    return (
        f"the model in {path} does not fit this run's ({detail}); check that the model flags "
        "(--num-layers, --hidden-size, --untie-embeddings-and-output-weights, ...) match the "
        "saved run's, and that --make-vocab-size-divisible-by x --tensor-model-parallel-size "
        "(the padded vocabulary's multiple) and the tokenizer are the saved run's"
    )


def _key_summary(missing: List[str], unexpected: List[str]) -> str:
    parts = []
    for what, names in (("missing", missing), ("unexpected", unexpected)):
        if names:
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            parts.append(f"{len(names)} {what} tensors: {shown}")
    return "; ".join(parts)


def _shape_summary(error: RuntimeError) -> str:
    """The first size mismatch of load_state_dict's message, and how many more there are."""
    lines = [line.strip() for line in str(error).splitlines() if "size mismatch" in line]
    if not lines:
        return str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
    more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
    return lines[0] + more


def _required(state: Dict[str, Any], key: str, path: str, skip_flag: str) -> Any:
    if key not in state:
        raise CheckpointError(
            f"checkpoint {path} has no {key!r} state (saved with --no-save-optim or "
            f"--no-save-rng?); pass {skip_flag} or --finetune to load without it"
        )
    return state[key]


def _consumed(state: Dict[str, Any], key: str) -> int:
    """Top-level key first; Megatron's own checkpoints keep the count only in args."""
    if key in state:
        return int(state[key])
    return int(getattr(state.get("args"), key, 0) or 0)
