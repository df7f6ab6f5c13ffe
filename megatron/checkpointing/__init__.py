"""Checkpoints in Megatron-LM's layout, saved atomically and resumed exactly.

    save_checkpoint(config.checkpoint, iteration, model, optimizer, scheduler, args=namespace,
                    consumed_train_samples=..., consumed_valid_samples=...)
    loaded = load_checkpoint(config.checkpoint, model, optimizer, scheduler)

`config.ckpt_format` picks the files: "torch_dist" (every rank writes its own chunks through
torch.distributed.checkpoint: `chunks`, `sharded_state`, `sharded_save`, `sharded_load`,
`async_save`) or "torch" (one file holding the tensors of a single-process run whatever the
layout: `full_state`, `pipeline_state`). Loading reads either. See `layout` for the files on
disk and `convert` for the mapping between the two formats.
"""

from megatron.checkpointing.full_state import (
    full_model_state_dict,
    full_optimizer_state_dict,
    load_full_model_state_dict,
    load_full_optimizer_state_dict,
)
from megatron.checkpointing.layout import (
    CHECKPOINT_FILENAME,
    RELEASE,
    TRACKER_FILENAME,
    CheckpointError,
    checkpoint_file,
    read_tracker,
    tracker_file,
)
from megatron.checkpointing.load import LoadedState, load_checkpoint, read_checkpoint_args
from megatron.checkpointing.rng import capture_rng_state, gather_rng_states, restore_rng_state
from megatron.checkpointing.save import CHECKPOINT_VERSION, save_checkpoint, unwrap_model

__all__ = [
    "CHECKPOINT_FILENAME",
    "CHECKPOINT_VERSION",
    "RELEASE",
    "TRACKER_FILENAME",
    "CheckpointError",
    "LoadedState",
    "capture_rng_state",
    "checkpoint_file",
    "full_model_state_dict",
    "full_optimizer_state_dict",
    "gather_rng_states",
    "load_checkpoint",
    "load_full_model_state_dict",
    "load_full_optimizer_state_dict",
    "read_checkpoint_args",
    "read_tracker",
    "restore_rng_state",
    "save_checkpoint",
    "tracker_file",
    "unwrap_model",
]
