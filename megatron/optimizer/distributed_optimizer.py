"""`--use-distributed-optimizer`: the optimizer step sharded over data parallelism (ZeRO-1).

A drop-in alternative to `MegatronOptimizer` for a model *not* wrapped in DDP: every rank keeps
the full parameters but only 1/dp of the optimizer state, as Megatron-LM's DistributedOptimizer.

Layout. The parameters of each dtype (all fp32 here: mixed precision is autocast) lie one after
another, in param-group order, in a flat *parameter buffer* padded at the end to split into
`dp_size` equal shards; rank r owns `[r * shard_size, (r + 1) * shard_size)`. The model's
parameters become views into it, so the all-gather writes updated weights in place. A
parameter may straddle a shard boundary: the inner torch optimizer gets one 1-D *piece* (a view
of the buffer: fp32 parameters are their own master weights) per parameter the shard overlaps,
in that parameter's group. A *grad buffer* of the same layout holds the gradients: `zero_grad`
binds each `param.grad` to its view so backward accumulates there (grads autograd re-created
elsewhere are copied in at `step`).

Step. Reduce-scatter the grad buffer into this rank's shard grad and divide by dp_size (the
mean over ranks, as DDP and Megatron; after the sum it touches 1/dp of the elements, and the
buffers are fp32), fp16 unscale + inf check (all-reduced), L2 norm from the shards
(all-reduced squares), clip, step the inner optimizer on the pieces, all-gather the shards.

Collectives: `reduce_scatter_single`/`all_gather_single` (torch 2.13; the deprecated `*_tensor`
names before). gloo has both since torch 2.2 (pytorch#112144, all-reduce plus slicing inside)
and this project needs torch>=2.4, so no gloo fallback is needed; the CPU tests run them.

Not covered yet: tensor/pipeline/expert parallelism (the norm is reduced over the DP group only;
expert parameters need the expert-data-parallel group) and overlap with backward.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron.config import OptimizerConfig, TrainingConfig
from megatron.optimizer.grad_scaler import GradScaler
from megatron.optimizer.optimizer import (
    StepResult,
    _unscale_and_check_for_inf,
    build_optimizer,
    load_keeping_kernel_flags,
)

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _FlatBuffer:
    """The parameters of one dtype, flat and padded to split evenly into data-parallel shards."""

    def __init__(self, params: List[nn.Parameter], dp_size: int, dp_rank: int) -> None:
        self.params = params
        self.offsets: List[int] = []
        self.numel = 0
        for param in params:
            self.offsets.append(self.numel)
            self.numel += param.numel()
        self.shard_size = -(-self.numel // dp_size)  # ceil: the padding goes at the end
        self.shard_start = dp_rank * self.shard_size
        padded = self.shard_size * dp_size
        dtype, device = params[0].dtype, params[0].device
        self.param_buffer = torch.zeros(padded, dtype=dtype, device=device)
        self.grad_buffer = torch.zeros(padded, dtype=dtype, device=device)
        self.shard_grad = torch.zeros(self.shard_size, dtype=dtype, device=device)
        with torch.no_grad():
            for param, offset in zip(params, self.offsets):
                view = self.param_buffer[offset : offset + param.numel()]
                view.copy_(param.detach().reshape(-1))
                param.data = view.view_as(param)

    @property
    def param_shard(self) -> torch.Tensor:
        """This rank's shard of the parameter buffer."""
        return self.param_buffer[self.shard_start : self.shard_start + self.shard_size]

    @property
    def local_numel(self) -> int:
        """Parameter elements in this rank's shard, padding excluded."""
        return max(0, min(self.shard_size, self.numel - self.shard_start))

    def grad_view(self, index: int) -> torch.Tensor:
        """The grad buffer's slice for `params[index]`, shaped like it."""
        param, offset = self.params[index], self.offsets[index]
        return self.grad_buffer[offset : offset + param.numel()].view_as(param)

    def local_range(self, index: int) -> Optional[tuple]:
        """`(start, end)` of `params[index].view(-1)` inside the local shard, or None."""
        offset = self.offsets[index]
        start = max(offset, self.shard_start)
        end = min(offset + self.params[index].numel(), self.shard_start + self.shard_size)
        return (start - offset, end - offset) if start < end else None

    def bind_grads(self) -> None:
        """Zero the grad buffer and make every `param.grad` its view, for backward to fill."""
        self.grad_buffer.zero_()
        for index, param in enumerate(self.params):
            param.grad = self.grad_view(index)

    def collect_grads(self) -> None:
        """Bring grads that do not live in the buffer (None, or re-created) into it."""
        for index, param in enumerate(self.params):
            view = self.grad_view(index)
            if param.grad is None:
                view.zero_()
            elif param.grad.data_ptr() != view.data_ptr():
                view.copy_(param.grad)


@dataclass
class _Piece:
    """The part of one parameter, `param.view(-1)[start:end]`, that this rank's shard holds."""

    full_index: int  # the parameter's index in a non-distributed optimizer's state_dict
    param: nn.Parameter
    buffer: _FlatBuffer
    start: int
    end: int
    shard_offset: int  # where the piece begins within the local shard
    tensor: torch.Tensor  # view of the parameter buffer the inner optimizer updates


@dataclass(frozen=True)
class OptimizerMemoryReport:
    """Optimizer-state bytes on one rank, sharded vs what `MegatronOptimizer` holds.

    Master weights are the fp32 parameters (for the sharded optimizer, views of this rank's
    shard of them); state is the inner optimizer's per-element tensors (Adam's exp_avg and
    exp_avg_sq, SGD's momentum). The grad buffers are left out: DDP holds as much.
    """

    data_parallel_size: int
    parameters: int
    local_parameters: int
    master_bytes_per_rank: int
    state_bytes_per_rank: int
    master_bytes_unsharded: int
    state_bytes_unsharded: int

    @property
    def bytes_per_rank(self) -> int:
        """Master-weight shard plus optimizer state on this rank."""
        return self.master_bytes_per_rank + self.state_bytes_per_rank

    @property
    def bytes_unsharded(self) -> int:
        """What the non-distributed optimizer holds on every rank."""
        return self.master_bytes_unsharded + self.state_bytes_unsharded

    def __str__(self) -> str:
        mib = 1024.0**2
        return (
            f"distributed optimizer over {self.data_parallel_size} data-parallel ranks: "
            f"optimizer state {self.bytes_per_rank / mib:.2f} MiB per rank (master weights "
            f"{self.master_bytes_per_rank / mib:.2f} + state {self.state_bytes_per_rank / mib:.2f})"
            f" instead of {self.bytes_unsharded / mib:.2f} MiB, saving "
            f"{(self.bytes_unsharded - self.bytes_per_rank) / mib:.2f} MiB per GPU"
        )


class DistributedOptimizer:
    """`MegatronOptimizer`'s interface with the optimizer state sharded over data parallelism.

    `optimizer` is a torch optimizer built over the model's parameters with no state yet (as
    `build_optimizer` makes it); its param groups are re-pointed at this rank's shard pieces,
    so the LR scheduler's writes to `param_groups` reach the sharded step. The model's
    parameters become views into flat buffers and are broadcast from data-parallel rank 0,
    as DDP does at construction; do not move the model afterwards.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        grad_scaler: Optional[GradScaler],
        clip_grad: float,
        log_num_zeros_in_grad: bool = False,
        data_parallel_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        if optimizer.state:
            raise ValueError("DistributedOptimizer needs a torch optimizer that has not stepped")
        self.optimizer = optimizer
        self.grad_scaler = grad_scaler
        self.clip_grad = clip_grad
        self.log_num_zeros_in_grad = log_num_zeros_in_grad
        self.group = data_parallel_group
        distributed = dist.is_available() and dist.is_initialized()
        self.dp_size = dist.get_world_size(data_parallel_group) if distributed else 1
        self.dp_rank = dist.get_rank(data_parallel_group) if distributed else 0
        # The model's parameters per group; flattened, a non-distributed state_dict's numbering.
        self.model_param_groups = [list(group["params"]) for group in optimizer.param_groups]
        self.model_params = [param for group in self.model_param_groups for param in group]
        by_dtype: Dict[torch.dtype, List[nn.Parameter]] = {}
        for param in self.model_params:
            by_dtype.setdefault(param.dtype, []).append(param)
        self.buffers = [
            _FlatBuffer(params, self.dp_size, self.dp_rank) for params in by_dtype.values()
        ]
        if self.dp_size > 1:
            source = dist.get_global_rank(data_parallel_group, 0) if data_parallel_group else 0
            for buffer in self.buffers:
                dist.broadcast(buffer.param_buffer, src=source, group=data_parallel_group)

        location = {
            id(param): (buffer, index)
            for buffer in self.buffers
            for index, param in enumerate(buffer.params)
        }
        self.pieces: List[_Piece] = []  # in the inner optimizer's state_dict numbering
        full_index = 0
        for group in optimizer.param_groups:
            group_pieces = []
            for param in group["params"]:
                buffer, index = location[id(param)]
                local = buffer.local_range(index)
                if local is not None:
                    start, end = local
                    shard_offset = buffer.offsets[index] + start - buffer.shard_start
                    tensor = buffer.param_shard[shard_offset : shard_offset + end - start]
                    tensor.grad = buffer.shard_grad[shard_offset : shard_offset + end - start]
                    piece = _Piece(full_index, param, buffer, start, end, shard_offset, tensor)
                    group_pieces.append(piece)
                full_index += 1
            group["params"] = [piece.tensor for piece in group_pieces]
            self.pieces.extend(group_pieces)
        self.zero_grad()

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        """The inner optimizer's param groups (the LR scheduler writes `lr` and `weight_decay`)."""
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale; 1.0 for bf16 and fp32."""
        return 1.0 if self.grad_scaler is None else self.grad_scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the loss scale, to call `backward` on."""
        return loss if self.grad_scaler is None else loss * self.grad_scaler.scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the grad buffers and bind every `param.grad` to its view of them.

        `set_to_none` is accepted for `MegatronOptimizer`'s signature; grads are never set to
        None because the buffer is where backward should accumulate.
        """
        for buffer in self.buffers:
            buffer.bind_grads()

    @torch.no_grad()
    def step(self) -> StepResult:
        """One update: `(update_successful, grad_norm, num_zeros_in_grad)`, as `MegatronOptimizer`.

        Collective over the data-parallel group: every rank must call it.
        """
        for buffer in self.buffers:
            buffer.collect_grads()
            if self.dp_size > 1:
                _reduce_scatter(buffer.shard_grad, buffer.grad_buffer, group=self.group)
                buffer.shard_grad.div_(self.dp_size)
            else:
                buffer.shard_grad.copy_(buffer.grad_buffer)
        shard_grads = [buffer.shard_grad for buffer in self.buffers]
        if self.grad_scaler is not None:
            # All-reduced over the default group: a skip must be taken by every rank.
            found_inf = _unscale_and_check_for_inf(
                shard_grads, self.grad_scaler.inv_scale, shard_grads[0].device
            )
            self.grad_scaler.update(found_inf)
            if found_inf:
                return False, None, None
        grad_norm = self._global_grad_norm()
        if self.clip_grad > 0.0:
            clip_coefficient = self.clip_grad / (grad_norm + 1.0e-6)
            if clip_coefficient < 1.0:
                torch._foreach_mul_(shard_grads, clip_coefficient)
        num_zeros_in_grad = self._count_zeros() if self.log_num_zeros_in_grad else None
        self.optimizer.step()
        if self.dp_size > 1:
            for buffer in self.buffers:
                shard = buffer.param_shard
                # NCCL all-gathers in place (input is the output's own slice); other backends
                # get a separate input so they never read a slice they are writing.
                if dist.get_backend(self.group) != "nccl":
                    shard = shard.clone()
                _all_gather(buffer.param_buffer, shard, group=self.group)
        return True, grad_norm, num_zeros_in_grad

    def state_dict(self) -> Dict[str, Any]:
        """This rank's shard: `{"optimizer", "grad_scaler" (fp16 only), "shard_layout"}`.

        Loads back only at the same data-parallel size and model; to change the DP size use
        `gather_full_state_dict` / `load_full_state_dict`.
        """
        state = {"optimizer": self.optimizer.state_dict(), "shard_layout": self._layout()}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore this rank's shard from `state_dict()` of a run with the same layout."""
        saved_layout = state_dict.get("shard_layout")
        if saved_layout != self._layout():
            raise ValueError(
                f"the optimizer shard was saved with layout {saved_layout} but this run has "
                f"{self._layout()}; a checkpoint written at another data-parallel size must be "
                "saved with gather_full_state_dict() and loaded with load_full_state_dict()"
            )
        load_keeping_kernel_flags(self.optimizer, state_dict["optimizer"])
        self._load_grad_scaler(state_dict)

    def gather_full_state_dict(self) -> Dict[str, Any]:
        """The unsharded state, structured as `MegatronOptimizer.state_dict()` on one rank.

        Collective over the data-parallel group; every rank gets the full state (CPU tensors).
        Load it into a `MegatronOptimizer`, or into a `DistributedOptimizer` of any DP size with
        `load_full_state_dict`.
        """
        inner = self.optimizer.state_dict()
        sharded_keys, small_entries = set(), {}
        for inner_index, entry in inner["state"].items():
            piece = self.pieces[inner_index]
            small = small_entries.setdefault(piece.full_index, {})
            for key, value in entry.items():
                if _is_piece_state(value, piece.tensor):
                    sharded_keys.add(key)
                else:
                    small[key] = value.cpu() if torch.is_tensor(value) else value
        gathered = [(sharded_keys, small_entries)]
        if self.dp_size > 1:
            gathered = [None] * self.dp_size
            dist.all_gather_object(gathered, (sharded_keys, small_entries), group=self.group)
        full_state: Dict[int, Dict[str, Any]] = {}
        for rank_keys, rank_entries in gathered:
            sharded_keys |= rank_keys
            for full_index, entry in rank_entries.items():
                full_state.setdefault(full_index, {}).update(entry)
        full_indices = {id(param): index for index, param in enumerate(self.model_params)}
        for key in sorted(sharded_keys):
            for buffer in self.buffers:
                full_flat = self._gather_state_key(buffer, key, inner["state"])
                for param, offset in zip(buffer.params, buffer.offsets):
                    entry = full_state.get(full_indices[id(param)])
                    if entry is not None:
                        value = full_flat[offset : offset + param.numel()].view_as(param)
                        entry[key] = value.cpu().clone()
        param_groups = copy.deepcopy(inner["param_groups"])
        next_index = 0
        for group, torch_group in zip(param_groups, self.model_param_groups):
            group["params"] = list(range(next_index, next_index + len(torch_group)))
            next_index += len(torch_group)
        state = {
            "optimizer": {"state": dict(sorted(full_state.items())), "param_groups": param_groups}
        }
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_full_state_dict(self, full_state_dict: Dict[str, Any]) -> None:
        """Take this rank's shard of an unsharded state (`MegatronOptimizer.state_dict()` or
        `gather_full_state_dict()`), whatever data-parallel size wrote it."""
        full = full_state_dict["optimizer"]
        group_sizes = [len(group["params"]) for group in full["param_groups"]]
        expected_sizes = [len(group) for group in self.model_param_groups]
        if group_sizes != expected_sizes:
            raise ValueError(
                f"the full optimizer state has param groups of sizes {group_sizes} but this "
                f"model's groups have {expected_sizes}: it was saved for another model"
            )
        full_ids = [index for group in full["param_groups"] for index in group["params"]]
        inner_state = {}
        for inner_index, piece in enumerate(self.pieces):
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
        for group, torch_group in zip(param_groups, self.optimizer.param_groups):
            group["params"] = list(range(next_index, next_index + len(torch_group["params"])))
            next_index += len(torch_group["params"])
        load_keeping_kernel_flags(
            self.optimizer, {"state": inner_state, "param_groups": param_groups}
        )
        self._load_grad_scaler(full_state_dict)

    def memory_report(self) -> OptimizerMemoryReport:
        """Optimizer-state bytes on this rank vs unsharded, for the log."""
        element_size = self.buffers[0].param_buffer.element_size()
        parameters = sum(buffer.numel for buffer in self.buffers)
        local = sum(buffer.local_numel for buffer in self.buffers)
        per_element = _state_tensors_per_element(self.optimizer)
        return OptimizerMemoryReport(
            data_parallel_size=self.dp_size,
            parameters=parameters,
            local_parameters=local,
            master_bytes_per_rank=local * element_size,
            state_bytes_per_rank=local * per_element * element_size,
            master_bytes_unsharded=parameters * element_size,
            state_bytes_unsharded=parameters * per_element * element_size,
        )

    def _global_grad_norm(self) -> float:
        squares = sum(buffer.shard_grad.float().square().sum() for buffer in self.buffers)
        return float(self._sum_over_ranks(squares).sqrt().item())

    def _count_zeros(self) -> int:
        zeros = sum((buffer.shard_grad[: buffer.local_numel] == 0).sum() for buffer in self.buffers)
        return int(self._sum_over_ranks(zeros).item())

    def _sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        if self.dp_size > 1:
            dist.all_reduce(value, group=self.group)
        return value

    def _gather_state_key(
        self, buffer: _FlatBuffer, key: str, inner_state: Dict[int, Dict[str, Any]]
    ) -> torch.Tensor:
        """All-gather state `key` of `buffer`'s parameters into one flat tensor."""
        local = torch.zeros_like(buffer.shard_grad)
        for inner_index, piece in enumerate(self.pieces):
            value = inner_state.get(inner_index, {}).get(key)
            if value is not None and piece.buffer is buffer:
                local[piece.shard_offset : piece.shard_offset + value.numel()] = value
        if self.dp_size == 1:
            return local
        full = torch.empty_like(buffer.grad_buffer)
        _all_gather(full, local, group=self.group)
        return full

    def _layout(self) -> Dict[str, Any]:
        return {
            "data_parallel_size": self.dp_size,
            "data_parallel_rank": self.dp_rank,
            "buffers": [(str(buffer.param_buffer.dtype), buffer.numel) for buffer in self.buffers],
        }

    def _load_grad_scaler(self, state_dict: Dict[str, Any]) -> None:
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])


def build_distributed_optimizer(
    model: nn.Module,
    optimizer_config: OptimizerConfig,
    training_config: TrainingConfig,
    data_parallel_group: Optional[dist.ProcessGroup] = None,
    log_num_zeros_in_grad: bool = False,
) -> DistributedOptimizer:
    """`build_optimizer`'s optimizer (same groups, hyper-parameters and loss scaler), sharded
    over `data_parallel_group` (the default group when None). The model must not be in DDP."""
    unsharded = build_optimizer(model, optimizer_config, training_config, log_num_zeros_in_grad)
    return DistributedOptimizer(
        unsharded.optimizer,
        unsharded.grad_scaler,
        unsharded.clip_grad,
        log_num_zeros_in_grad,
        data_parallel_group,
    )


def _is_piece_state(value: Any, piece: torch.Tensor) -> bool:
    """True for per-element state (exp_avg, momentum); False for `step` and non-tensors."""
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == piece.shape


def _is_param_state(key: str, value: Any, param: torch.Tensor) -> bool:
    """True for per-element state of a full parameter; a 0-dim parameter's `step` is not."""
    return (
        torch.is_tensor(value) and value.shape == param.shape and (param.dim() > 0 or key != "step")
    )


def _state_tensors_per_element(optimizer: torch.optim.Optimizer) -> int:
    """Per-element state tensors the optimizer keeps once it has stepped."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 3 if optimizer.defaults.get("amsgrad") else 2
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if optimizer.defaults.get("momentum", 0.0) != 0.0 else 0
    raise ValueError(f"memory_report does not know the state of {type(optimizer).__name__}")
