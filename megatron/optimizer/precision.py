"""`--use-precision-aware-optimizer` and `--optimizer-cpu-offload`: AdamW whose state need not be
fp32 or on the GPU (Megatron-Core's flags; docs/training.md, "Optimizer state: precision and
offload").

`PrecisionAwareAdamW` is torch's AdamW with three differences:
- Adam's moments are kept in `--exp-avg-dtype` / `--exp-avg-sq-dtype` (fp32 or bf16) and the
  gradient may be a bf16 main gradient (megatron.main_grads); the update is still computed in
  fp32, the moments upcast and rounded back per element (megatron.kernels.adamw);
- the first `offload_fraction` of its parameters (by elements, in order) keep their moments
  and an fp32 copy of their weights in pinned host memory and are updated there by the CPU: their gradients are copied to the host while the
  GPU updates the other parameters, and each updated weight is copied back as soon as the CPU
  has it;
- its `state_dict` is torch AdamW's (the same keys and numbering, the moments in their own
  dtypes), so checkpoints move between this optimizer and torch's, and between state dtypes:
  a moment that arrives in another dtype is converted, and `loaded_state_conversion` says how
  (the load line prints it).

fp16 moments are refused (megatron.config.validation): without a per-tensor scale, whose value
would depend on how the tensor is sharded, Adam's second moment underflows fp16.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch

from megatron.config.numerics import DTYPES
from megatron.kernels.adamw import (
    STEP_CHUNK,
    AdamWHyper,
    adamw_step_,
    chunked_fp32_step_,
    fp32_adamw_step_,
)
from megatron.main_grads import gradient

MOMENTS = ("exp_avg", "exp_avg_sq")


def dtype_name(dtype: torch.dtype) -> str:
    """ "fp32", "bf16" or "fp16" for a torch dtype (its str otherwise)."""
    names = {value: key for key, value in DTYPES.items()}
    return names.get(dtype, str(dtype).replace("torch.", ""))


class _HostCopy:
    """An offloaded parameter's fp32 weights and the pinned buffer its gradient lands in."""

    def __init__(self, param: torch.Tensor, grad_dtype: torch.dtype) -> None:
        pin = param.is_cuda
        self.weights = torch.empty(param.shape, dtype=torch.float32, pin_memory=pin)
        self.grad = torch.empty(param.shape, dtype=grad_dtype, pin_memory=pin)
        self.weights.copy_(param.detach())
        self.arrived: Optional[torch.cuda.Event] = None


class PrecisionAwareAdamW(torch.optim.Optimizer):
    """AdamW with moments in `exp_avg_dtype` / `exp_avg_sq_dtype` and, for `offload_fraction`
    of the parameters, state and update on the host (module docstring). Gradients are read
    with `megatron.main_grads.gradient`. Parameters must be fp32. Which parameters are
    offloaded is decided at first use, from the param groups as they are then (the
    distributed optimizer points them at its shards first)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        betas: Sequence[float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        offload_fraction: float = 0.0,
    ) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.state_dtypes = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}
        for dtype in self.state_dtypes.values():
            if dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(f"moments in {dtype} are not supported; use fp32 or bf16")
        self.offload_fraction = offload_fraction
        self._offloaded_ids: Optional[set] = None
        self._host: Dict[int, _HostCopy] = {}
        self._copy_stream: Optional[Any] = None
        self._host_scratch: Optional[torch.Tensor] = None
        self.loaded_state_conversion: Optional[str] = None

    def is_offloaded(self, param: torch.Tensor) -> bool:
        """Whether `param`'s state and update live on the host."""
        if self._offloaded_ids is None:
            params = [param for group in self.param_groups for param in group["params"]]
            chosen = offloaded_share(params, self.offload_fraction)
            self._offloaded_ids = {id(param) for param in chosen}
        return id(param) in self._offloaded_ids

    def offloaded_numel(self) -> int:
        """Parameter elements whose state is on the host."""
        return sum(
            param.numel()
            for group in self.param_groups
            for param in group["params"]
            if self.is_offloaded(param)
        )

    def describe(self, main_grads_dtype: Optional[torch.dtype]) -> str:
        """The start-up line: the dtypes, and what is offloaded."""
        grads = dtype_name(main_grads_dtype or torch.float32)
        moments = ", ".join(f"{key} {dtype_name(d)}" for key, d in self.state_dtypes.items())
        line = f"precision-aware optimizer: main gradients {grads}, {moments}, update in fp32"
        if self.offload_fraction > 0.0:
            params = [param for group in self.param_groups for param in group["params"]]
            total = sum(param.numel() for param in params)
            offloaded = self.offloaded_numel()
            state_bytes = sum(
                torch.empty((), dtype=d).element_size() for d in self.state_dtypes.values()
            )
            host_gib = offloaded * (state_bytes + 4) / 2**30
            line += (
                f"; the state of {offloaded:,} of {total:,} parameters in pinned host memory "
                f"({host_gib:.2f} GiB of moments and fp32 weights), updated by the CPU"
            )
        return line

    def _state_device(self, param: torch.Tensor) -> torch.device:
        return torch.device("cpu") if self.is_offloaded(param) else param.device

    def _init_state(self, param: torch.Tensor) -> Dict[str, Any]:
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            pin = self.is_offloaded(param) and param.is_cuda
            for key, dtype in self.state_dtypes.items():
                state[key] = torch.zeros(
                    param.shape, dtype=dtype, device=self._state_device(param), pin_memory=pin
                )
        return state

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch.optim.Optimizer's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        host_work = []
        for group in self.param_groups:
            for param in group["params"]:
                grad = gradient(param)
                if grad is None:
                    continue
                if self.is_offloaded(param):
                    host_work.append((group, param, self._send_grad_to_host(param, grad)))
        for group in self.param_groups:
            for param in group["params"]:
                grad = gradient(param)
                if grad is not None and not self.is_offloaded(param):
                    self._update(group, param, param, grad)
        for group, param, host in host_work:
            if host.arrived is not None:
                host.arrived.synchronize()
            self._update(group, param, host.weights, host.grad, on_host=True)
            param.copy_(host.weights, non_blocking=True)
        return loss

    def _send_grad_to_host(self, param: torch.Tensor, grad: torch.Tensor) -> _HostCopy:
        """Start copying `grad` into `param`'s pinned host buffer, on a side stream so the
        copy overlaps the GPU's own updates."""
        host = self._host.get(id(param))
        if host is None or host.grad.dtype != grad.dtype:
            host = self._host[id(param)] = _HostCopy(param, grad.dtype)
        if not grad.is_cuda:
            host.grad.copy_(grad)
            return host
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(grad.device)
        self._copy_stream.wait_stream(torch.cuda.current_stream(grad.device))
        with torch.cuda.stream(self._copy_stream):
            host.grad.copy_(grad, non_blocking=True)
            host.arrived = torch.cuda.Event()
            host.arrived.record()
        return host

    def _update(
        self, group, param, weights: torch.Tensor, grad: torch.Tensor, on_host: bool = False
    ) -> None:
        state = self._init_state(param)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        hyper = AdamWHyper(
            lr=float(group["lr"]),
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            step=int(state["step"].item()),
        )
        if on_host:
            self._host_scratch = host_adamw_step_(
                weights, grad, state["exp_avg"], state["exp_avg_sq"], hyper, self._host_scratch
            )
        else:
            adamw_step_(weights, grad, state["exp_avg"], state["exp_avg_sq"], hyper)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """torch's load, except that the moments go straight into this optimizer's dtypes and
        devices (torch would first cast them to the parameters' fp32 on the GPU);
        `loaded_state_conversion` names any dtype conversion."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(saved["params"]) != len(group["params"])
            for saved, group in zip(saved_groups, self.param_groups)
        ):
            raise ValueError(
                "loaded state dict has a different number of parameter groups or parameters "
                "than this optimizer"
            )
        by_saved_id = {
            saved_id: param
            for saved, group in zip(saved_groups, self.param_groups)
            for saved_id, param in zip(saved["params"], group["params"])
        }
        state: Dict[torch.Tensor, Dict[str, Any]] = {}
        for saved_id, entry in state_dict["state"].items():
            param = by_saved_id.get(saved_id)
            if param is None:
                continue
            placed = {}
            for key, value in entry.items():
                if key in self.state_dtypes:
                    value = _placed(value, self.state_dtypes[key], self._state_device(param))
                elif key == "step":
                    # A copy: the step counts up in place, and the caller's dict keeps its own.
                    value = torch.as_tensor(value).detach().to("cpu", torch.float32).reshape(())
                    value = value.clone()
                placed[key] = value
            state[param] = placed
        self.state.clear()
        self.state.update(state)
        for saved, group in zip(saved_groups, self.param_groups):
            group.update({key: value for key, value in saved.items() if key != "params"})
        # Host copies of the weights are taken again from the loaded model at the next step.
        self._host.clear()
        self.loaded_state_conversion = conversion_note(
            saved_moment_dtypes(state_dict), self.state_dtypes
        )


def host_adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hyper: AdamWHyper,
    scratch: Optional[torch.Tensor],
) -> torch.Tensor:
    """The CPU's AdamW step for an offloaded parameter: chunk by chunk, the gradient and the
    moments upcast into reused fp32 scratch (fresh temporaries would fault in new pages every
    chunk), torch's fused CPU AdamW on them, the moments rounded back. Returns the scratch."""
    if scratch is None:
        scratch = torch.empty(3 * STEP_CHUNK, dtype=torch.float32)
    fp32_step = _fused_cpu_step_ if _fused_cpu_adamw_available() else fp32_adamw_step_
    chunked_fp32_step_(param, grad, exp_avg, exp_avg_sq, hyper, fp32_step, scratch)
    return scratch


def _fused_cpu_step_(param, grad, exp_avg, exp_avg_sq, hyper: AdamWHyper) -> None:
    torch._fused_adamw_(
        [param], [grad], [exp_avg], [exp_avg_sq], [], [torch.tensor(float(hyper.step))],
        lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2, weight_decay=hyper.weight_decay,
        eps=hyper.eps, amsgrad=False, maximize=False,
    )  # fmt: skip


@functools.cache
def _fused_cpu_adamw_available() -> bool:
    """Whether this torch has the fused AdamW kernel for CPU tensors (asked once, at the first
    offloaded step); without it the host runs the reference's single-tensor formula."""
    try:
        tensors = [torch.zeros(1) for _ in range(4)]
        _fused_cpu_step_(*tensors, AdamWHyper(0.1, 0.9, 0.9, 1e-8, 0.0, 1))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return True


def _placed(value: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if value.dtype == dtype and value.device == device:
        return value
    pin = device.type == "cpu" and torch.cuda.is_available()
    placed = torch.empty(value.shape, dtype=dtype, device=device, pin_memory=pin)
    placed.copy_(value)
    return placed


def saved_moment_dtypes(state_dict: Dict[str, Any]) -> Dict[str, torch.dtype]:
    """The dtype of each Adam moment in a torch optimizer's `state_dict`."""
    dtypes: Dict[str, torch.dtype] = {}
    for entry in state_dict.get("state", {}).values():
        for key in MOMENTS:
            value = entry.get(key)
            if torch.is_tensor(value):
                dtypes.setdefault(key, value.dtype)
    return dtypes


def conversion_note(saved: Dict[str, torch.dtype], kept: Dict[str, torch.dtype]) -> Optional[str]:
    """ "exp_avg fp32 -> bf16, ..." for the moments saved in another dtype than `kept`, or None."""
    changes = [
        f"{key} {dtype_name(saved[key])} -> {dtype_name(kept[key])}"
        for key in MOMENTS
        if key in saved and key in kept and saved[key] != kept[key]
    ]
    return ", ".join(changes) if changes else None


def offloaded_share(params: List[torch.Tensor], fraction: float) -> List[torch.Tensor]:
    """The first parameters of `params`, in order, holding `fraction` of their elements (the
    parameter that crosses the fraction included; none for 0, all for 1)."""
    total = sum(param.numel() for param in params)
    chosen, count = [], 0
    for param in params:
        if count >= fraction * total or fraction <= 0.0:
            break
        chosen.append(param)
        count += param.numel()
    return chosen
