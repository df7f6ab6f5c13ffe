"""Resume from the checkpoint the tracker names, with Megatron's --no-load-*/--finetune rules."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict

import torch
import torch.distributed as dist
from torch import nn

from megatron.checkpointing.full_state import (
    load_full_model_state_dict,
    load_full_optimizer_state_dict,
)
from megatron.checkpointing.layout import (
    RELEASE,
    CheckpointError,
    Iteration,
    checkpoint_file,
    leftover_temporaries,
    read_tracker,
    tracker_file,
)
from megatron.checkpointing.pipeline_state import (
    load_pipeline_model_state_dict,
    load_pipeline_optimizer_state_dict,
)
from megatron.checkpointing.rng import (
    data_parallel_rank,
    restore_rng_state,
    saved_rng_state_index,
)
from megatron.checkpointing.save import is_pipeline_parallel, unwrap_model
from megatron.initialize import print_rank_0
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
) -> LoadedState:
    """Load the checkpoint named by `{config.load}/latest_checkpointed_iteration.txt`.

    `config` is a CheckpointConfig (or anything with its fields). Without --load or a tracker
    file, training starts from scratch (iteration 0). --no-load-optim skips optimizer and
    scheduler state, --no-load-rng the RNG states; --finetune and release checkpoints load
    only the model weights and restart at iteration 0 with no consumed samples.
    """
    if not config.load:
        print_fn("no --load given: training from scratch (iteration 0)")
        return LoadedState(0, 0, 0, None)
    iteration = read_tracker(config.load)
    if iteration is None:
        print_fn(
            f"WARNING: could not find the tracker file {tracker_file(config.load)}; "
            "training from scratch (iteration 0)"
        )
        return LoadedState(0, 0, 0, None)
    path = checkpoint_file(config.load, iteration)
    state = _read_checkpoint_file(config.load, iteration, path)

    model_only = bool(config.finetune) or iteration == RELEASE
    _load_model_state(unwrap_model(model), state["model"], path)
    if not model_only and not config.no_load_optim:
        if optimizer is not None:
            optimizer_state = _required(state, "optimizer", path, "--no-load-optim")
            # Checkpoints hold the unsharded state: a rank takes its stage's, tensor-parallel
            # and expert shards' part, and the distributed optimizer its data-parallel shard
            # of that.
            unsharded_view = getattr(optimizer, "unsharded_view", None)
            if unsharded_view is not None:
                optimizer = unsharded_view(gather=False)
            if is_pipeline_parallel():
                load_pipeline_optimizer_state_dict(
                    optimizer, unwrap_model(model), optimizer_state, state["model"]
                )
            else:
                load_full_optimizer_state_dict(optimizer, optimizer_state)
        if scheduler is not None:
            scheduler.load_state_dict(
                _required(state, "opt_param_scheduler", path, "--no-load-optim")
            )
    if not model_only and not config.no_load_rng:
        rng_states = _required(state, "rng_state", path, "--no-load-rng")
        index, seeded_streams = saved_rng_state_index(
            rng_states, data_parallel_rank(data_parallel_group)
        )
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
    print_fn(f"loaded checkpoint {path} at iteration {iteration}")
    return loaded


def read_checkpoint_args(load_dir: str) -> argparse.Namespace | None:
    """The arguments saved with the latest checkpoint under `load_dir`; None without a tracker."""
    iteration = read_tracker(load_dir)
    if iteration is None:
        return None
    path = checkpoint_file(load_dir, iteration)
    return _read_checkpoint_file(load_dir, iteration, path).get("args")


def _read_checkpoint_file(root: str, iteration: Iteration, path: str) -> Dict[str, Any]:
    advice = (
        f"point {tracker_file(root)} at a complete checkpoint, or remove the damaged checkpoint "
        "and the tracker to start from scratch"
    )
    if not os.path.isfile(path):
        interrupted = [p for p in leftover_temporaries(root, iteration) if os.path.isdir(p)]
        hint = (
            f"; interrupted saves of this iteration remain in {interrupted}" if interrupted else ""
        )
        raise CheckpointError(
            f"the tracker names iteration {iteration}, but checkpoint file {path} does not "
            f"exist{hint}; {advice}"
        )
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


def _load_model_state(model: nn.Module, model_state: Dict[str, Any], path: str) -> None:
    pipeline = is_pipeline_parallel()
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
        raise CheckpointError(
            f"model weights in {path} do not match the model: missing keys {missing}, "
            f"unexpected keys {unexpected}; check that the model flags (--num-layers, "
            "--untie-embeddings-and-output-weights, ...) match the saved run's"
        )
    try:
        if pipeline:
            load_pipeline_model_state_dict(model, model_state)
        else:
            load_full_model_state_dict(model, model_state)
    except RuntimeError as exc:
        raise CheckpointError(
            f"model weights in {path} do not fit the model: {exc}; check the model flags, and "
            "that --make-vocab-size-divisible-by x --tensor-model-parallel-size (the padded "
            "vocabulary's multiple) is the saved run's"
        ) from exc


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
