"""Layout-free checkpoints under pipeline parallelism: every stage's tensors gathered to the
writer under single-process names, and each stage taking its own from a full checkpoint.

The model state is the single-process one: `decoder.layers.<global index>...`, in the
single-process order, without the last stage's copy of tied embeddings. The optimizer state is
re-indexed to the single-process numbering (torch numbers parameters across the param groups
in order: the weight-decay group, then the no-decay group, each in model order), so a file
written by a pipeline run loads in one process and the other way round. Each stage's tensor-
parallel shards are gathered (and cut on load) by `full_state` as in other layouts.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Set

import torch
import torch.distributed as dist
from torch import nn

from megatron.checkpointing.full_state import (
    full_model_state_dict,
    full_optimizer_state_dict,
    load_full_model_state_dict,
    load_full_optimizer_state_dict,
)
from megatron.parallel import parallel_state
from megatron.pipeline.stages import (
    WORD_EMBEDDINGS_KEY,
    full_name,
    full_to_stage_state_dict,
    stage_to_full_names,
)

_LAYER_NUMBER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _model_order(name: str) -> tuple:
    """Sort key of the single-process state-dict order (stable sorting keeps each layer's
    tensors in module order)."""
    if name.startswith("embedding."):
        return (0, 0)
    match = _LAYER_NUMBER.match(name)
    if match is not None:
        return (1, int(match.group(1)))
    if name.startswith("decoder."):
        return (2, 0)
    return (3, 0)


def _optimizer_order(
    model_state: Dict[str, torch.Tensor], parameter_names: Set[str]
) -> List[List[str]]:
    """Parameter names of the single-process optimizer's two groups (decay, no decay), by
    `param_groups_for_weight_decay`'s rule; `model_state` in single-process order. Its
    persistent buffers (the MoE expert bias and pending counts) are not numbered."""
    parameters = {n: t for n, t in model_state.items() if n in parameter_names}
    decay = [n for n, t in parameters.items() if not (n.endswith(".bias") or t.dim() == 1)]
    no_decay = [n for n, t in parameters.items() if n.endswith(".bias") or t.dim() == 1]
    return [decay, no_decay]


def _whole_model_parameter_names(chunks: nn.ModuleList) -> Set[str]:
    """Single-process names of the parameters of every stage; collective over the pipeline
    group (from the full state dict alone a stage cannot tell another stage's persistent
    buffers from its parameters)."""
    local = [full_name(chunk, name) for chunk in chunks for name, _ in chunk.named_parameters()]
    gathered: List[Any] = [None] * parallel_state.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(
        gathered,
        [name for name in local if name is not None],
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return {name for stage in gathered for name in stage}


def _gather_to_first_stage(local: Any) -> Optional[List[Any]]:
    """`local` of every pipeline stage, in stage order, on the first stage; None elsewhere."""
    first = parallel_state.get_pipeline_model_parallel_first_rank()
    is_first = parallel_state.get_pipeline_model_parallel_rank() == 0
    gathered: Optional[List[Any]] = (
        [None] * parallel_state.get_pipeline_model_parallel_world_size() if is_first else None
    )
    dist.gather_object(
        local, gathered, dst=first, group=parallel_state.get_pipeline_model_parallel_group()
    )
    return gathered


def pipeline_full_model_state_dict(chunks: nn.ModuleList) -> Optional[Dict[str, torch.Tensor]]:
    """The whole model's single-process state dict on the first stage (None on the others).
    Collective over the pipeline and tensor-parallel groups."""
    local: Dict[str, torch.Tensor] = {}
    for chunk in chunks:
        state = stage_to_full_names(full_model_state_dict(chunk), chunk)
        local.update({name: tensor.detach().cpu() for name, tensor in state.items()})
    gathered = _gather_to_first_stage(local)
    if gathered is None:
        return None
    merged = [item for stage in gathered for item in stage.items()]
    return dict(sorted(merged, key=lambda item: _model_order(item[0])))


def load_pipeline_model_state_dict(chunks: nn.ModuleList, full_state: Dict[str, Any]) -> None:
    """Each chunk takes its tensors (its tensor-parallel shards) from a full state dict."""
    for chunk in chunks:
        load_full_model_state_dict(chunk, full_to_stage_state_dict(full_state, chunk))


def _local_names(optimizer: Any, chunks: nn.ModuleList) -> List[Optional[str]]:
    """Single-process name of each of the optimizer's parameters in torch's numbering (None
    for the last stage's copy of tied embeddings)."""
    names = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            names[id(param)] = full_name(chunk, name)
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def pipeline_full_optimizer_state_dict(
    optimizer: Any, chunks: nn.ModuleList, model_state: Optional[Dict[str, torch.Tensor]]
) -> Optional[Dict[str, Any]]:
    """The single-process optimizer state on the first stage (None elsewhere); `model_state`
    is `pipeline_full_model_state_dict`'s result there. Collective like it."""
    state = full_optimizer_state_dict(optimizer)
    inner = state["optimizer"]
    names = _local_names(optimizer, chunks)
    parameter_names = _whole_model_parameter_names(chunks)
    named = {
        names[index]: {
            key: value.detach().cpu() if torch.is_tensor(value) else value
            for key, value in param_state.items()
        }
        for index, param_state in inner["state"].items()
        if names[index] is not None
    }
    gathered = _gather_to_first_stage(named)
    if gathered is None:
        return None
    merged = {name: value for stage in gathered for name, value in stage.items()}
    groups = _optimizer_order(model_state, parameter_names)
    _check_two_groups(inner["param_groups"])
    numbered = [name for group in groups for name in group]
    index_of = {name: index for index, name in enumerate(numbered)}
    param_groups, start = [], 0
    for hyperparameters, group in zip(inner["param_groups"], groups):
        param_groups.append({**hyperparameters, "params": list(range(start, start + len(group)))})
        start += len(group)
    full_inner = {
        "state": {index_of[name]: value for name, value in merged.items()},
        "param_groups": param_groups,
    }
    return {**state, "optimizer": full_inner}


def load_pipeline_optimizer_state_dict(
    optimizer: Any,
    chunks: nn.ModuleList,
    full_state: Dict[str, Any],
    model_state: Dict[str, torch.Tensor],
) -> None:
    """Load a single-process optimizer state: each parameter of this stage takes the state of
    its single-process name (the tied-embedding copy that of the table). Collective over the
    pipeline group."""
    parameter_names = _whole_model_parameter_names(chunks)
    numbered = [name for group in _optimizer_order(model_state, parameter_names) for name in group]
    index_of = {name: index for index, name in enumerate(numbered)}
    full_inner = full_state["optimizer"]
    _check_two_groups(full_inner["param_groups"])
    _check_two_groups(optimizer.param_groups)
    names = _local_names(optimizer, chunks)
    local_state, param_groups, start = {}, [], 0
    for saved_group, group in zip(full_inner["param_groups"], optimizer.param_groups):
        indices = list(range(start, start + len(group["params"])))
        start += len(group["params"])
        param_groups.append({**saved_group, "params": indices})
        for index in indices:
            global_index = index_of[names[index] or WORD_EMBEDDINGS_KEY]
            if global_index in full_inner["state"]:
                local_state[index] = full_inner["state"][global_index]
    local = {**full_state, "optimizer": {"state": local_state, "param_groups": param_groups}}
    load_full_optimizer_state_dict(optimizer, local)


def _check_two_groups(param_groups: List[Dict[str, Any]]) -> None:
    if len(param_groups) != 2:
        raise RuntimeError(
            f"pipeline checkpoints expect the optimizer's two param groups (weight decay, no "
            f"weight decay), found {len(param_groups)}"
        )
