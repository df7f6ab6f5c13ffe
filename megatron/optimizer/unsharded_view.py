"""The distributed optimizer's state unsharded over data parallelism: gathered into the
state_dict() of a `MegatronOptimizer` of the same rank, taken back from one, and the view
megatron.checkpointing reads and writes it through (megatron.optimizer.distributed_optimizer)."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Dict, Optional

import torch
import torch.distributed as dist

from megatron.optimizer.optimizer import load_keeping_kernel_flags
from megatron.optimizer.sharded_buffer import ShardedBuffer, all_gather_into

if TYPE_CHECKING:
    from megatron.optimizer.distributed_optimizer import DistributedOptimizer


class UnshardedView:
    """A `DistributedOptimizer` as megatron.checkpointing sees the `MegatronOptimizer` of the
    same rank: `param_groups` over the model's parameters (whose attributes say which are
    tensor-parallel or expert shards, or a pipeline stage's), `state_dict()` the gathered
    unsharded state, and `load_state_dict` taking this rank's data-parallel shard of such a
    state. The tensor-, expert- and pipeline-parallel gathering and cutting of checkpoints then
    apply to it unchanged, so its checkpoints hold the single-process state."""

    def __init__(self, optimizer: DistributedOptimizer, full_state: Optional[Dict[str, Any]]):
        self._optimizer = optimizer
        self._full_state = full_state
        self.param_groups = [
            {**{key: value for key, value in group.items() if key != "params"}, "params": params}
            for group, params in zip(optimizer.param_groups, optimizer.model_param_groups)
        ]

    def state_dict(self) -> Dict[str, Any]:
        """The state gathered when the view was made."""
        if self._full_state is None:
            raise RuntimeError(
                "this view was made without gathering the state; call "
                "DistributedOptimizer.unsharded_view(gather=True) on every rank first"
            )
        return self._full_state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Take this rank's shard of an unsharded state of this rank's parameters."""
        self._optimizer.load_full_state_dict(state_dict)


def gather_full_state(optimizer: DistributedOptimizer) -> Dict[str, Any]:
    """The unsharded state of this rank's parameters, structured as the state_dict() of a
    `MegatronOptimizer` over the same model (its tensor-parallel shards, stage, experts).

    Collective over the data-parallel group (and the expert-data-parallel group with
    expert-parallel parameters); every rank gets the full state (CPU tensors). Load it into
    a `MegatronOptimizer`, or into a `DistributedOptimizer` of any DP size with
    `load_full_state`.
    """
    inner = optimizer.optimizer.state_dict()
    full_indices = {id(param): index for index, param in enumerate(optimizer.model_params)}
    full_state: Dict[int, Dict[str, Any]] = {}
    for buffer in optimizer.buffers:
        sharded_keys = _gather_small_state(optimizer, buffer, inner["state"], full_state)
        for key in sorted(sharded_keys):
            full_flat = _gather_state_key(optimizer, buffer, key, inner["state"])
            for param, offset in zip(buffer.params, buffer.offsets):
                entry = full_state.get(full_indices[id(param)])
                if entry is not None:
                    value = full_flat[offset : offset + param.numel()].view_as(param)
                    entry[key] = value.cpu().clone()
    param_groups = copy.deepcopy(inner["param_groups"])
    next_index = 0
    for group, torch_group in zip(param_groups, optimizer.model_param_groups):
        group["params"] = list(range(next_index, next_index + len(torch_group)))
        next_index += len(torch_group)
    state = {"optimizer": {"state": dict(sorted(full_state.items())), "param_groups": param_groups}}
    if optimizer.grad_scaler is not None:
        state["grad_scaler"] = optimizer.grad_scaler.state_dict()
    return state


def load_full_state(optimizer: DistributedOptimizer, full_state_dict: Dict[str, Any]) -> None:
    """Take this rank's shard of an unsharded state (`MegatronOptimizer.state_dict()` or
    `gather_full_state()` over the same parameters), whatever DP size wrote it."""
    full = full_state_dict["optimizer"]
    group_sizes = [len(group["params"]) for group in full["param_groups"]]
    expected_sizes = [len(group) for group in optimizer.model_param_groups]
    if group_sizes != expected_sizes:
        raise ValueError(
            f"the full optimizer state has param groups of sizes {group_sizes} but this "
            f"model's groups have {expected_sizes}: it was saved for another model"
        )
    full_ids = [index for group in full["param_groups"] for index in group["params"]]
    inner_state = {}
    for inner_index, piece in enumerate(optimizer.pieces):
        entry = full["state"].get(full_ids[piece.full_index])
        if entry is None:
            continue
        inner_state[inner_index] = {
            key: value.reshape(-1)[piece.start : piece.end].clone()
            if _is_param_state(key, value, piece.param)
            else value
            for key, value in entry.items()
        }
    param_groups = copy.deepcopy(full["param_groups"])
    next_index = 0
    for group, torch_group in zip(param_groups, optimizer.optimizer.param_groups):
        group["params"] = list(range(next_index, next_index + len(torch_group["params"])))
        next_index += len(torch_group["params"])
    load_keeping_kernel_flags(
        optimizer.optimizer, {"state": inner_state, "param_groups": param_groups}
    )


def _gather_small_state(
    optimizer: DistributedOptimizer,
    buffer: ShardedBuffer,
    inner_state: Dict[int, Dict[str, Any]],
    full_state: Dict[int, Dict[str, Any]],
) -> set:
    """Merge the non-per-element state (Adam's `step`) of `buffer`'s pieces on every rank
    of its group into `full_state`; the names of the per-element state keys."""
    sharded_keys, small_entries = set(), {}
    for inner_index, entry in inner_state.items():
        piece = optimizer.pieces[inner_index]
        if piece.buffer is not buffer:
            continue
        small = small_entries.setdefault(piece.full_index, {})
        for key, value in entry.items():
            if _is_piece_state(value, piece.tensor):
                sharded_keys.add(key)
            else:
                small[key] = value.cpu() if torch.is_tensor(value) else value
    gathered = [(sharded_keys, small_entries)]
    if buffer.size > 1:
        gathered = [None] * buffer.size
        dist.all_gather_object(gathered, (sharded_keys, small_entries), group=buffer.group)
    for rank_keys, rank_entries in gathered:
        sharded_keys |= rank_keys
        for full_index, entry in rank_entries.items():
            full_state.setdefault(full_index, {}).update(entry)
    return sharded_keys


def _gather_state_key(
    optimizer: DistributedOptimizer,
    buffer: ShardedBuffer,
    key: str,
    inner_state: Dict[int, Dict[str, Any]],
) -> torch.Tensor:
    """All-gather state `key` of `buffer`'s parameters into one flat tensor."""
    values = [
        (piece, inner_state.get(inner_index, {}).get(key))
        for inner_index, piece in enumerate(optimizer.pieces)
        if piece.buffer is buffer
    ]
    dtypes = {value.dtype for _, value in values if value is not None}
    # Every rank must agree on the dtype; a state key's dtype is the run's, on every rank.
    dtype = dtypes.pop() if len(dtypes) == 1 else buffer.step_shard.dtype
    local = torch.zeros(buffer.shard_size, dtype=dtype, device=buffer.param_buffer.device)
    for piece, value in values:
        if value is not None:
            local[piece.shard_offset : piece.shard_offset + value.numel()] = value
    if buffer.size == 1:
        return local
    full = torch.empty(buffer.grad_buffer.numel(), dtype=dtype, device=local.device)
    all_gather_into(full, local, buffer.group)
    return full


def _is_piece_state(value: Any, piece: torch.Tensor) -> bool:
    """True for per-element state (exp_avg, momentum); False for `step` and non-tensors."""
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == piece.shape


def _is_param_state(key: str, value: Any, param: torch.Tensor) -> bool:
    """True for per-element state of a full parameter; a 0-dim parameter's `step` is not."""
    return (
        torch.is_tensor(value) and value.shape == param.shape and (param.dim() > 0 or key != "step")
    )
