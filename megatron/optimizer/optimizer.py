"""The training step's optimizer: fp16 unscaling and overflow skip, grad-norm clipping, AdamW/SGD.

Parameters and gradients are fp32 (mixed precision is autocast), so the inner torch optimizer
updates the model's own parameters: they are the fp32 master weights. Under data parallelism
(torch DDP) the gradients are already averaged when `step` runs, so every rank holds the same
gradients and computes the same norm; only the overflow flag is all-reduced, so that a rank
whose own check differed cannot step alone. Under tensor parallelism each rank holds part of
the gradient, under pipeline parallelism its stage's layers, and under expert parallelism
its own experts' part: the norm adds the ranks' shares (see `MegatronOptimizer._counted_grads`).
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from megatron.config import OptimizerConfig, TrainingConfig
from megatron.config.numerics import Numerics
from megatron.main_grads import attach_main_grads, gradient
from megatron.model import param_groups_for_weight_decay
from megatron.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, GradScaler
from megatron.optimizer.precision import (
    PrecisionAwareAdamW,
    conversion_note,
    saved_moment_dtypes,
)
from megatron.parallel import parallel_state
from megatron.parallel.dtensors import is_dtensor, local_part, shard_groups
from megatron.parallel.expert_parameters import is_expert_parameter

StepResult = Tuple[bool, Optional[float], Optional[int]]


class MegatronOptimizer:
    """Wraps a torch optimizer with loss scaling (fp16 only), overflow skip and grad clipping."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        grad_scaler: Optional[GradScaler],
        clip_grad: float,
        log_num_zeros_in_grad: bool = False,
        main_grads_dtype: Optional[torch.dtype] = None,
    ) -> None:
        self.optimizer = optimizer
        self.grad_scaler = grad_scaler
        self.clip_grad = clip_grad
        self.log_num_zeros_in_grad = log_num_zeros_in_grad
        # --main-grads-dtype bf16: the gradients live in these buffers (megatron.main_grads).
        self.main_grad_buffers = (
            attach_main_grads(self._params(), main_grads_dtype)
            if main_grads_dtype is not None
            else []
        )

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
        """Clear the gradients of every parameter this optimizer updates."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for buffer in self.main_grad_buffers:
            buffer.zero()

    def unsharded_view(self, gather: bool) -> MegatronOptimizer:
        """What checkpoints save and load: an optimizer whose `state_dict` is this rank's whole
        state, unsharded over data parallelism (this one itself; the distributed optimizer's
        view gathers its shards when `gather`, a collective)."""
        return self

    def state_pieces(self) -> List[Tuple[torch.Tensor, torch.Tensor, Optional[int]]]:
        """What the inner optimizer's state is keyed by, in its own numbering, for the sharded
        checkpoints: `(model parameter, key, flat start)`, where the key's elements start at
        `flat start` of the flattened parameter (None: the key is the whole parameter)."""
        return [(param, param, None) for param in self._params()]

    @torch.no_grad()
    def step(self) -> StepResult:
        """One update: `(update_successful, grad_norm, num_zeros_in_grad)`.

        fp16: the gradients are unscaled in place and checked for inf/nan on every rank; on an
        overflow the update is skipped, the loss scale is updated and `(False, None, None)` is
        returned. Otherwise the global L2 norm (before clipping) is computed, the gradients are
        clipped to `clip_grad` when it is positive, and the inner optimizer steps. Without fp16
        a non-finite norm does not skip the step (as in Megatron); the norm is returned so the
        caller can count such iterations. `num_zeros_in_grad` is None unless requested.
        """
        grads = self._grads_to_step()
        if self.grad_scaler is not None:
            found_inf = _unscale_and_check_for_inf(
                grads, self.grad_scaler.inv_scale, self._device()
            )
            self.grad_scaler.update(found_inf)
            if found_inf:
                return False, None, None
        grad_norm = self._global_grad_norm(grads)
        if self.clip_grad > 0.0:
            clip_coefficient = self.clip_grad / (grad_norm + 1.0e-6)
            if clip_coefficient < 1.0:
                for device_grads in _by_device(grads).values():
                    torch._foreach_mul_(device_grads, clip_coefficient)
        num_zeros_in_grad = self._count_zeros() if self.log_num_zeros_in_grad else None
        self.optimizer.step()
        self._after_step()
        return True, grad_norm, num_zeros_in_grad

    def _grads_to_step(self) -> List[torch.Tensor]:
        """The gradients the inner optimizer will read, ready to unscale, measure and clip."""
        return self._grads()

    def _after_step(self) -> None:
        """Work after the inner optimizer's step (the distributed optimizer's all-gather)."""

    def state_dict(self) -> Dict[str, Any]:
        """`{"optimizer": ..., "grad_scaler": ...}`; the scaler entry only with fp16."""
        state = {"optimizer": self.optimizer.state_dict()}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore from `state_dict()`; a checkpoint without a scaler keeps the current scale.

        The kernel choice (fused/foreach) stays the one picked for this run's devices, so a
        checkpoint written on GPU loads on CPU and the other way round.
        """
        load_keeping_kernel_flags(self.optimizer, state_dict["optimizer"])
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    def _global_grad_norm(self, grads: List[torch.Tensor]) -> float:
        """L2 norm of the whole model's gradient (`grads`: this rank's, all parameters).

        Each rank counts its share (`_counted_grads`) and the squares are summed over the
        groups that split the model (`_norm_groups`), so every rank gets the same norm. One
        process, or no model or expert parallelism, is the plain norm of `grads`.
        """
        if any(is_dtensor(grad) for grad in grads):
            return float(self._sharded_total(_sum_of_squares).sqrt().item())
        groups = self._norm_groups()
        if not groups:
            return _global_grad_norm(grads)
        squares = _sum_of_squares(self._counted_grads(), self._device())
        for group in groups:
            dist.all_reduce(squares, group=group)
        return float(squares.sqrt().item())

    def _count_zeros(self) -> int:
        """Zero gradient elements of the whole model, counted like `_global_grad_norm`."""
        if any(is_dtensor(grad) for grad in self._grads()):
            return int(self._sharded_total(_zeros_count).item())
        groups = self._norm_groups()
        if not groups:
            return _count_zeros(self._grads())
        zeros = torch.tensor(float(_count_zeros(self._counted_grads())), device=self._device())
        for group in groups:
            dist.all_reduce(zeros, group=group)
        return int(zeros.item())

    def _norm_groups(self) -> List[Optional[dist.ProcessGroup]]:
        """The groups whose ranks hold different parts of the gradient, to sum squares over."""
        groups = []
        if (
            parallel_state.get_tensor_model_parallel_world_size() > 1
            or parallel_state.get_pipeline_model_parallel_world_size() > 1
        ):
            # Tensor x pipeline ranks: each stage holds other layers, each TP rank other shards.
            groups.append(parallel_state.get_model_parallel_group())
        if parallel_state.get_expert_model_parallel_world_size() > 1:
            groups.append(parallel_state.get_expert_model_parallel_group())
        return groups

    def _counted_grads(self) -> List[torch.Tensor]:
        """This rank's share of the gradient, each element counted on exactly one rank of the
        groups of `_norm_groups`.

        Tensor parallelism, Megatron's rule: a sharded parameter's gradient counts on every
        rank (the shards add up to it), a replicated one (norms, row-parallel biases, position
        embeddings) only on TP rank 0. Expert parallelism (megatron.parallel.expert_parameters): each rank of
        an expert-parallel group holds other experts, which all count, while the rest of the
        gradient is the same on all of them after the data-parallel all-reduce and counts only
        on expert-parallel rank 0. Pipeline parallelism: every stage's parameters count, except
        the last stage's copy of tied word embeddings (`shared_embedding`), which after the
        embedding-group all-reduce equals the first stage's and is counted there.
        """
        first_expert_rank = parallel_state.get_expert_model_parallel_rank() == 0
        return [
            gradient(param)
            for param in self._params()
            if gradient(param) is not None
            and counted_across_model_parallel_ranks(param)
            and (is_expert_parameter(param) or first_expert_rank)
        ]

    def _sharded_total(
        self, measure: Callable[[List[torch.Tensor], torch.device], torch.Tensor]
    ) -> torch.Tensor:
        """`measure` (a sum over tensors) of the whole model's gradient when the gradients are
        DTensor shards over the data-parallel ranks (FSDP2), which each rank holds a different
        part of: each rank measures its parts, summed over the ranks of their shards
        (megatron.parallel.dtensors.shard_groups), then over `_norm_groups` as `_counted_grads`
        says. The dense parameters' shards span the expert-parallel ranks too: once summed they
        are the same on all of them and count on the first."""
        device = self._device()
        total = torch.zeros((), dtype=torch.float64, device=device)
        first_expert_rank = parallel_state.get_expert_model_parallel_rank() == 0
        for experts in (False, True):
            params = [
                param
                for param in self._params()
                if gradient(param) is not None and is_expert_parameter(param) == experts
            ]
            # Keyed by the groups of every parameter's shards, so that every rank of a group
            # reduces over it, whichever parameters it counts.
            parts: Dict[Tuple[dist.ProcessGroup, ...], List[torch.Tensor]] = {
                shard_groups(gradient(param)): [] for param in params
            }
            for param in params:
                local = local_part(gradient(param))
                if counted_across_model_parallel_ranks(param) and local.numel() > 0:
                    parts[shard_groups(gradient(param))].append(local)
            for groups, tensors in parts.items():
                part = measure(tensors, device).double()
                for group in groups:
                    dist.all_reduce(part, group=group)
                if experts or first_expert_rank:
                    total += part
        for group in self._norm_groups():
            dist.all_reduce(total, group=group)
        return total

    def _params(self) -> List[torch.Tensor]:
        return [param for group in self.optimizer.param_groups for param in group["params"]]

    def _grads(self) -> List[torch.Tensor]:
        return [gradient(param) for param in self._params() if gradient(param) is not None]

    def _device(self) -> torch.device:
        return self._params()[0].device


def counted_across_model_parallel_ranks(param: torch.Tensor) -> bool:
    """Whether this rank counts `param`'s gradient in the model's norm, summed over the
    tensor x pipeline ranks: a tensor-parallel shard on every rank, a TP-replicated parameter
    on TP rank 0 only, and the last stage's copy of the tied word embeddings
    (`shared_embedding`) nowhere, since the first stage counts the same values."""
    if getattr(param, "shared_embedding", False):
        return False
    return (
        getattr(param, "tensor_model_parallel", False)
        or parallel_state.get_tensor_model_parallel_rank() == 0
    )


def build_optimizer(
    model: nn.Module,
    optimizer_config: OptimizerConfig,
    training_config: TrainingConfig,
    log_num_zeros_in_grad: bool = False,
) -> MegatronOptimizer:
    """AdamW (or SGD with momentum) over `model`, wrapped for loss scaling and clipping.

    Weight decay applies to weight matrices and embeddings only (Megatron's grouping); the
    groups carry `wd_mult` 1.0/0.0 so the LR scheduler keeps it that way. fp16 gets a dynamic
    loss scaler, or a constant one with `--loss-scale`; bf16 and fp32 have none. With
    --use-precision-aware-optimizer or --optimizer-cpu-offload the AdamW is
    `PrecisionAwareAdamW`, and --main-grads-dtype bf16 gives the parameters main gradients.
    """
    optimizer, grad_scaler = build_inner_optimizer(model, optimizer_config, training_config)
    return MegatronOptimizer(
        optimizer,
        grad_scaler,
        optimizer_config.clip_grad,
        log_num_zeros_in_grad,
        Numerics.of(training_config, optimizer_config).main_grads_dtype,
    )


def build_inner_optimizer(
    model: nn.Module, optimizer_config: OptimizerConfig, training_config: TrainingConfig
) -> Tuple[torch.optim.Optimizer, Optional[GradScaler]]:
    """The torch optimizer over `model`'s parameter groups, and the fp16 loss scaler."""
    config = optimizer_config
    decay, no_decay = param_groups_for_weight_decay(model, config.weight_decay)
    decay["wd_mult"], no_decay["wd_mult"] = 1.0, 0.0
    param_groups = [group for group in (decay, no_decay) if group["params"]]
    if not param_groups:
        raise ValueError("the model has no trainable parameters (all have requires_grad=False)")
    params = decay["params"] + no_decay["params"]

    numerics = Numerics.of(training_config, config)
    if config.optimizer == "adam" and (
        config.use_precision_aware_optimizer or config.optimizer_cpu_offload
    ):
        optimizer: torch.optim.Optimizer = PrecisionAwareAdamW(
            param_groups,
            lr=config.lr,
            weight_decay=config.weight_decay,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            exp_avg_dtype=numerics.exp_avg_dtype,
            exp_avg_sq_dtype=numerics.exp_avg_sq_dtype,
            offload_fraction=numerics.offload_fraction,
        )
    elif config.optimizer == "adam":
        kernel: Dict[str, Any] = {}
        if all(param.is_cuda for param in params) and _adamw_has_fused():
            kernel["fused"] = True
        optimizer = torch.optim.AdamW(
            param_groups,
            lr=config.lr,
            weight_decay=config.weight_decay,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            **kernel,
        )
    elif config.optimizer == "sgd":
        optimizer = torch.optim.SGD(
            param_groups,
            lr=config.lr,
            weight_decay=config.weight_decay,
            momentum=config.sgd_momentum,
        )
    else:
        raise ValueError(f"--optimizer {config.optimizer!r} is not supported; use adam or sgd")

    grad_scaler: Optional[GradScaler] = None
    if numerics.loss_scaling:
        if config.loss_scale is not None:
            grad_scaler = ConstantGradScaler(config.loss_scale)
        else:
            grad_scaler = DynamicGradScaler(
                initial_scale=config.initial_loss_scale,
                min_scale=config.min_loss_scale,
                growth_factor=2.0,
                backoff_factor=0.5,
                growth_interval=int(config.loss_scale_window),
                hysteresis=config.hysteresis,
            )
    return optimizer, grad_scaler


def _adamw_has_fused() -> bool:
    return "fused" in inspect.signature(torch.optim.AdamW.__init__).parameters


def _by_device(tensors: List[torch.Tensor]) -> Dict[torch.device, List[torch.Tensor]]:
    groups: Dict[torch.device, List[torch.Tensor]] = defaultdict(list)
    for tensor in tensors:
        groups[tensor.device].append(tensor)
    return groups


def _unscale_and_check_for_inf(
    grads: List[torch.Tensor], inv_scale: float, device: torch.device
) -> bool:
    """Multiply `grads` by `inv_scale` in place; True if any rank saw an inf or nan."""
    found_inf = torch.zeros(1, dtype=torch.float32, device=device)
    for grad_device, device_grads in _by_device(grads).items():
        device_found_inf = torch.zeros(1, dtype=torch.float32, device=grad_device)
        device_inv_scale = torch.full((1,), inv_scale, dtype=torch.float32, device=grad_device)
        torch._amp_foreach_non_finite_check_and_unscale_(
            device_grads, device_found_inf, device_inv_scale
        )
        found_inf = torch.maximum(found_inf, device_found_inf.to(device))
    # Every rank takes part, even one without gradients, so the collective always matches.
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
    return bool(found_inf.item() > 0)


def load_keeping_kernel_flags(optimizer: torch.optim.Optimizer, state: Dict[str, Any]) -> None:
    """`optimizer.load_state_dict(state)`, keeping this run's fused/foreach choice, so that a
    checkpoint written on GPU loads on CPU and the other way round."""
    kernel_flags = [
        {key: group[key] for key in ("fused", "foreach") if key in group}
        for group in optimizer.param_groups
    ]
    if isinstance(optimizer, torch.optim.AdamW):
        # torch casts the moments to the parameters' fp32; say so when they were not.
        saved = saved_moment_dtypes(state)
        kept = {key: torch.float32 for key in saved}
        optimizer.loaded_state_conversion = conversion_note(saved, kept)
    optimizer.load_state_dict(state)
    for group, flags in zip(optimizer.param_groups, kernel_flags):
        group.update(flags)


def _global_grad_norm(grads: List[torch.Tensor]) -> float:
    """L2 norm over all gradients, in fp32; a fixed reduction order makes it deterministic."""
    if not grads:
        return 0.0
    per_tensor_norms = []
    for device_grads in _by_device(grads).values():
        per_tensor_norms.extend(_per_tensor_norms(device_grads))
    first_device = per_tensor_norms[0].device
    stacked = torch.stack([norm.float().to(first_device) for norm in per_tensor_norms])
    return float(torch.linalg.vector_norm(stacked, 2.0).item())


def _sum_of_squares(grads: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squared L2 norms of `grads`, as an fp32 scalar on `device` (0 without grads)."""
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for device_grads in _by_device(grads).values():
        norms = _per_tensor_norms(device_grads)
        squares += torch.stack([norm.float() for norm in norms]).square().sum().to(device)
    return squares


def _zeros_count(grads: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.tensor(float(_count_zeros(grads)), dtype=torch.float64, device=device)


def _per_tensor_norms(grads: List[torch.Tensor]) -> List[torch.Tensor]:
    """L2 norm of each gradient (all on one device).

    On CPU the fp32 norm of a large tensor accumulates visible rounding error (about 6e-5
    relative for 3.2M values), enough for a model split over ranks to log another norm than one
    process; CPU tensors are therefore summed in float64. GPU reductions stay fp32 (they are
    accurate to ~1e-7 and the pass is bandwidth-bound).
    """
    if grads[0].device.type == "cpu":
        return torch._foreach_norm(grads, 2.0, dtype=torch.float64)
    # bf16 main gradients are summed in fp32 (a bf16 norm would keep 3 significant digits).
    return torch._foreach_norm(grads, 2.0, dtype=torch.float32)


def _count_zeros(grads: List[torch.Tensor]) -> int:
    if not grads:
        return 0
    counts = [(grad == 0).sum() for grad in grads]
    first_device = counts[0].device
    return int(torch.stack([count.to(first_device) for count in counts]).sum().item())
