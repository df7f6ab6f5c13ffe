"""Conversion between the two checkpoint formats, in one process, tensor for tensor.

`--ckpt-format torch` holds a single-process run's state in one file, with the optimizer state
numbered as torch numbers parameters (the weight-decay group, then the no-decay group, each in
model order); `torch_dist` holds the same tensors under names (megatron.checkpointing.
sharded_state). The numbering is the model's, so the caller passes its parameter names per
optimizer group and its state-dict order (tools/convert_checkpoint_format.py takes them from
the model the checkpoint's arguments build).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import torch

from megatron.checkpointing.chunks import ChunkedTensor
from megatron.checkpointing.progress import batches_by_bytes, progress_bar
from megatron.checkpointing.sharded_state import (
    MODEL_PREFIX,
    SCALAR_PREFIX,
    STATE_PREFIX,
    state_prefix,
    stored_optimizer_keys,
)
from megatron.checkpointing.torch_dist import (
    FORMAT,
    read_common,
    read_sharded_tensors,
    read_tensor_metadata,
)
from megatron.model import param_groups_for_weight_decay

# common.pt's keys that a torch-format checkpoint does not have.
_SHARDED_ONLY_KEYS = ("ckpt_format", "optimizer_common")
# What one read of a whole-tensor conversion asks torch.distributed.checkpoint for at a time: large
# enough that its planning per call is negligible, small enough that a bar moves.
READ_BATCH_BYTES = 1 << 30


def read_sharded_as_torch_state(
    directory: str, model_keys: Sequence[str], parameter_groups: Sequence[Sequence[str]]
) -> Dict[str, Any]:
    """The torch-format state dict of the torch_dist checkpoint in `directory` (an iteration's
    directory): whole tensors, the model in `model_keys` order, the optimizer numbered by
    `parameter_groups` (single-process names per optimizer group)."""
    common = read_common(directory)
    tensors = _read_whole_tensors(directory, lambda name: True)
    model = {name: tensors[MODEL_PREFIX + name] for name in model_keys}
    optimizer_common = common.get("optimizer_common")
    optimizer = None
    if optimizer_common is not None:
        numbered = [name for group in parameter_groups for name in group]
        keys_by_name = stored_optimizer_keys(tensors)
        per_parameter: Dict[int, Dict[str, torch.Tensor]] = {}
        for index, name in enumerate(numbered):
            entry = {}
            for prefix, key in keys_by_name.get(name, []):
                tensor = tensors[f"{prefix}{name}.{key}"]
                entry[key] = tensor if prefix == STATE_PREFIX else tensor.reshape(())
            if entry:
                per_parameter[index] = dict(sorted(entry.items(), key=_state_key_order))
        param_groups, start = [], 0
        for hyperparameters, group in zip(optimizer_common["param_groups"], parameter_groups):
            param_groups.append(
                {**hyperparameters, "params": list(range(start, start + len(group)))}
            )
            start += len(group)
        optimizer = {"optimizer": {"state": per_parameter, "param_groups": param_groups}}
        if "grad_scaler" in optimizer_common:
            optimizer["grad_scaler"] = optimizer_common["grad_scaler"]
    # The torch format's key order: the tensors come after the consumed sample counts.
    state: Dict[str, Any] = {}
    for key, value in common.items():
        if key in _SHARDED_ONLY_KEYS:
            continue
        state[key] = value
        if key == "consumed_valid_samples":
            state["model"] = model
            if optimizer is not None:
                state["optimizer"] = optimizer
    return state


def read_sharded_model_state(directory: str, model_keys: Sequence[str]) -> Dict[str, torch.Tensor]:
    """The single-process model state dict of the torch_dist checkpoint in `directory`, in
    `model_keys` order; the optimizer's tensors (twice the model's and more) are not read."""
    tensors = _read_whole_tensors(directory, lambda name: name.startswith(MODEL_PREFIX))
    return {name: tensors[MODEL_PREFIX + name] for name in model_keys}


def _read_whole_tensors(directory: str, wanted) -> Dict[str, torch.Tensor]:
    """The stored tensors whose names `wanted` accepts, each read whole."""
    stored = read_tensor_metadata(directory).state_dict_metadata
    tensors = {
        name: torch.empty(tuple(metadata.size), dtype=metadata.properties.dtype)
        for name, metadata in stored.items()
        if wanted(name)
    }
    sizes = [(name, tensor.numel() * tensor.element_size()) for name, tensor in tensors.items()]
    # Read in batches of about READ_BATCH_BYTES, so that a terminal shows how far it got.
    with progress_bar(f"reading {directory}", sum(size for _, size in sizes), "B") as bar:
        for names, batch_bytes in batches_by_bytes(sizes, READ_BATCH_BYTES):
            chunks = {
                name: ChunkedTensor(
                    tensors[name].shape, [((0,) * tensors[name].dim(), tensors[name])]
                )
                for name in names
            }
            read_sharded_tensors(directory, chunks, None)
            bar.update(batch_bytes)
    return tensors


def torch_state_as_sharded(
    state: Dict[str, Any], parameter_groups: Sequence[Sequence[str]]
) -> tuple[Dict[str, ChunkedTensor], Dict[str, Any]]:
    """A torch-format state dict as what a one-process torch_dist save writes: the tensors
    (each one whole chunk) and `common.pt`'s content."""
    tensors = {MODEL_PREFIX + name: _whole(tensor) for name, tensor in state["model"].items()}
    common = {key: value for key, value in state.items() if key not in ("model", "optimizer")}
    common["ckpt_format"] = FORMAT
    if "optimizer" in state:
        inner = state["optimizer"]["optimizer"]
        numbered = [name for group in parameter_groups for name in group]
        saved_count = sum(len(group["params"]) for group in inner["param_groups"])
        if saved_count != len(numbered):
            raise ValueError(
                f"the optimizer state numbers {saved_count} parameters, the model has "
                f"{len(numbered)}: the checkpoint's arguments do not build its model"
            )
        indices = [index for group in inner["param_groups"] for index in group["params"]]
        for position, index in enumerate(indices):
            name = numbered[position]
            for key, value in inner["state"].get(index, {}).items():
                prefix = state_prefix(value, state["model"][name].shape)
                if prefix == STATE_PREFIX:
                    tensors[f"{prefix}{name}.{key}"] = _whole(value)
                elif prefix == SCALAR_PREFIX:
                    tensors[f"{prefix}{name}.{key}"] = _whole(value.reshape(1))
        optimizer_common: Dict[str, Any] = {
            "param_groups": [
                {key: value for key, value in group.items() if key != "params"}
                for group in inner["param_groups"]
            ]
        }
        if "grad_scaler" in state["optimizer"]:
            optimizer_common["grad_scaler"] = state["optimizer"]["grad_scaler"]
        common["optimizer_common"] = optimizer_common
    return tensors, common


def _whole(tensor: torch.Tensor) -> ChunkedTensor:
    return ChunkedTensor(tensor.shape, [((0,) * tensor.dim(), tensor)])


def _state_key_order(item: tuple) -> tuple:
    """torch's Adam order (step first), so a converted state prints like a saved one."""
    return (item[0] != "step", item[0])


def model_order_names(
    model: torch.nn.Module, weight_decay: float
) -> tuple[List[str], List[List[str]]]:
    """A single-process model's state-dict keys, and its parameter names per optimizer group
    (megatron.model.param_groups_for_weight_decay's groups, in torch's numbering order)."""
    names = {id(param): name for name, param in model.named_parameters()}
    groups = param_groups_for_weight_decay(model, weight_decay)
    return list(model.state_dict().keys()), [
        [names[id(param)] for param in group["params"]] for group in groups if group["params"]
    ]
