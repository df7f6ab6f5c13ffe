"""`--ckpt-format torch` checkpoints hold the full, unsharded model: the tensors of a
single-process run.

Saving gathers every tensor-parallel shard over its TP group, and every expert shard over its
expert-parallel group, before rank 0 writes, so a file written in any layout has the same keys
and shapes as a single-process run's; loading cuts this rank's shard out of the full tensor. A
checkpoint therefore resumes at any TP, expert-parallel (and DP) size. The optimizer state gets
the same treatment: a state tensor shaped like its sharded parameter (Adam's exp_avg and
exp_avg_sq, SGD's momentum) is gathered and cut like the parameter; scalars such as Adam's
`step` are kept as they are.

A rank's part of a full tensor is cut by the rule torch_dist loads by
(megatron.checkpointing.chunks): its tensor-parallel blocks, its experts, and under FSDP2
(`--use-torch-fsdp2`, whose parameters and optimizer state are DTensors) its rows of those.

Which tensors are shards is read from the parameters' attributes: `tensor_model_parallel`,
`partition_dim` and `partition_stride`, set by the parallel layers, and
`expert_model_parallel` (megatron.parallel.expert_parameters), whose [E/P, ...] slices are experts
[r * E/P, (r + 1) * E/P) of the full [E, ...] tensor on expert-parallel rank r.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List

import torch
import torch.distributed as dist
from torch import nn

from megatron.checkpointing.chunks import chunks_like
from megatron.parallel import parallel_state
from megatron.parallel.dtensors import is_dtensor
from megatron.parallel.expert_parameters import is_expert_parameter
from megatron.tensor_parallel import gather_tensor_model_parallel_weight


def _is_tensor_parallel_shard(tensor: torch.Tensor) -> bool:
    return getattr(tensor, "tensor_model_parallel", False)


def _is_shard(tensor: torch.Tensor) -> bool:
    return _is_tensor_parallel_shard(tensor) or is_expert_parameter(tensor) or is_dtensor(tensor)


def _sharded_layout() -> bool:
    """Whether any parameter can be a tensor- or expert-parallel shard: otherwise a save's
    state dicts pass through unchanged (a load's also hold none of FSDP2's, `_holds_shards`)."""
    return (
        parallel_state.get_tensor_model_parallel_world_size() > 1
        or parallel_state.get_expert_model_parallel_world_size() > 1
    )


def _holds_shards(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether any of `tensors` (a model's, an optimizer's parameters) can be a shard: in a
    tensor- or expert-parallel layout, or a DTensor (FSDP2's rows over the data-parallel
    ranks). Otherwise a full state loads as it is."""
    return _sharded_layout() or any(is_dtensor(tensor) for tensor in tensors)


def _full_shape(shard: torch.Tensor) -> torch.Size:
    # A DTensor's shape is already whole over the data-parallel ranks.
    shape = list(shard.shape)
    if _is_tensor_parallel_shard(shard):
        shape[shard.partition_dim] *= parallel_state.get_tensor_model_parallel_world_size()
    if is_expert_parameter(shard):
        shape[0] *= parallel_state.get_expert_model_parallel_world_size()
    return torch.Size(shape)


def full_model_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """`model.state_dict()` with every tensor- and expert-parallel shard replaced by the full
    tensor.

    A collective over the tensor- and expert-parallel groups when their size is above 1: every
    rank of the writer's groups (expert-data-parallel rank 0) must call it.
    """
    if not _sharded_layout():
        return model.state_dict()
    return {
        name: _gather_like(tensor, tensor) if _is_shard(tensor) else tensor.detach()
        for name, tensor in model.state_dict(keep_vars=True).items()
    }


def load_full_model_state_dict(model: nn.Module, full_state: Dict[str, torch.Tensor]) -> None:
    """Load a full (single-process) state dict, keeping this rank's shard of each split tensor.

    Raises RuntimeError naming the key when a saved tensor does not have the full shape.
    """
    state = model.state_dict(keep_vars=True)
    if not _holds_shards(state.values()):
        model.load_state_dict(full_state, strict=True)
        return
    local_state = {}
    for name, tensor in state.items():
        saved = full_state[name]
        if _is_shard(tensor):
            if saved.shape != _full_shape(tensor):
                raise RuntimeError(
                    f"{name}: the checkpoint holds shape {tuple(saved.shape)}, but this model's "
                    f"full tensor is {tuple(_full_shape(tensor))} (this rank's shard "
                    f"{tuple(tensor.shape)})"
                )
            saved = _shard_like(saved, tensor)
        local_state[name] = saved
    model.load_state_dict(local_state, strict=True)


def full_optimizer_state_dict(optimizer: Any) -> Dict[str, Any]:
    """`optimizer.state_dict()` (a MegatronOptimizer) with the per-parameter state of sharded
    parameters gathered to full tensors. Collective like `full_model_state_dict`."""
    state = optimizer.state_dict()
    if not _sharded_layout():
        return state
    return _map_sharded_states(optimizer, state, _gather_like, lambda param: param.shape)


def load_full_optimizer_state_dict(optimizer: Any, full_state: Dict[str, Any]) -> None:
    """Load a full optimizer state (saved in any layout), keeping this rank's shards."""
    if _holds_shards(param for group in optimizer.param_groups for param in group["params"]):
        full_state = _map_sharded_states(optimizer, full_state, _shard_like, _full_shape)
    optimizer.load_state_dict(full_state)


def _gather_like(shard: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The full tensor of `shard`, a tensor split like `param`: tensor-parallel shards are
    joined first, then expert blocks (the inverse of `_shard_like`)."""
    full = shard.detach()
    if _is_tensor_parallel_shard(param):
        full = gather_tensor_model_parallel_weight(
            full, param.partition_dim, param.partition_stride
        )
    if is_expert_parameter(param):
        full = _gather_expert_blocks(full)
    return full


def _shard_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full`, split like `param`: a new tensor (so that it keeps no view
    of `full` alive) shaped and split like `param`, a DTensor when `param` is one, holding the
    chunks a torch_dist load would read into it."""
    # A DTensor's part lives on its mesh's device; a plain one stays beside `full` until
    # load_state_dict moves it, as the whole tensors do.
    device = None if is_dtensor(param) else full.device
    part = torch.empty_like(param, dtype=full.dtype, device=device)
    for offsets, view in chunks_like(param, part).chunks:
        rows = tuple(slice(start, start + size) for start, size in zip(offsets, view.shape))
        view.copy_(full[rows])
    return part


def _gather_expert_blocks(block: torch.Tensor) -> torch.Tensor:
    """[E/P, ...] blocks of the expert-parallel ranks, in rank order: [E, ...]."""
    block = block.contiguous()
    blocks = [
        torch.empty_like(block)
        for _ in range(parallel_state.get_expert_model_parallel_world_size())
    ]
    dist.all_gather(blocks, block, group=parallel_state.get_expert_model_parallel_group())
    return torch.cat(blocks, dim=0)


def _map_sharded_states(
    optimizer: Any,
    state: Dict[str, Any],
    convert: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    expected_shape: Callable[[torch.Tensor], torch.Size],
) -> Dict[str, Any]:
    """A copy of `state` whose per-parameter state tensors of sharded parameters, when shaped
    `expected_shape(param)`, went through `convert(tensor, param)`; the rest is shared."""
    # torch numbers parameters 0, 1, ... across param groups in order; so does this list.
    params: List[torch.Tensor] = [
        param for group in optimizer.param_groups for param in group["params"]
    ]
    inner = state["optimizer"]
    converted_states = {}
    for index, param_state in inner["state"].items():
        param = params[index]
        if not _is_shard(param):
            converted_states[index] = param_state
            continue
        shape = expected_shape(param)
        converted_states[index] = {
            key: convert(value, param)
            if torch.is_tensor(value) and value.dim() > 0 and value.shape == shape
            else value
            for key, value in param_state.items()
        }
    return {**state, "optimizer": {**inner, "state": converted_states}}
