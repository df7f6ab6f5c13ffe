"""Main gradients in another dtype than the parameters: bf16 beside fp32 parameters
(`--main-grads-dtype bf16`), or fp32 beside the bf16/fp16 weights the distributed optimizer holds
in the compute dtype (megatron.parallelize.data_parallel).

Autograd insists that a parameter's `.grad` has the parameter's dtype. The main gradient
therefore lives beside it, as Megatron-Core's `param.main_grad`: a view of one flat buffer per dtype that
backward accumulates into through a post-accumulate-grad hook (each micro-batch's fp32 `.grad`
is added in and dropped), or directly where a layer adds its own gradients (moe.weight_copies).
Whatever reads or reduces a gradient after backward takes `gradient(param)`, which is the main
gradient where there is one and `.grad` otherwise.

torch DDP reduces `.grad` from its own autograd hooks, which the hook here would race; with
main gradients the data-parallel reduction is `megatron.parallelize.gradient_sync.
all_reduce_data_parallel_gradients` after the last backward instead
(megatron.parallelize.gradient_sync.replicated_reduction).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
from torch import nn

MAIN_GRAD = "main_grad"
_WRITTEN_HOOKS = "_gradient_written_hooks"


def on_gradient_written(param: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
    """Call `hook(param)` whenever a layer that adds `param`'s gradient itself, outside
    autograd, has added some (`gradient_written`); autograd's own accumulation is watched with
    `param.register_post_accumulate_grad_hook`."""
    hooks = getattr(param, _WRITTEN_HOOKS, None)
    if hooks is None:
        hooks = []
        setattr(param, _WRITTEN_HOOKS, hooks)
    hooks.append(hook)


def gradient_written(param: torch.Tensor) -> None:
    """Said by a layer that has just added to `param`'s gradient (`gradient(param)`) itself."""
    for hook in getattr(param, _WRITTEN_HOOKS, ()):
        hook(param)


def gradient(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The gradient the step uses: `param.main_grad` if it has one, else `param.grad`."""
    main_grad = getattr(param, MAIN_GRAD, None)
    return main_grad if main_grad is not None else param.grad


def _add_to_main_grad(param: torch.Tensor) -> None:
    # Runs once autograd has accumulated this backward's gradient into `.grad`.
    param.main_grad.add_(param.grad)
    param.grad = None


class MainGradBuffer:
    """One flat buffer of `dtype` holding the main gradients of `params` (all on one device),
    each parameter's `main_grad` a view of it; `zero()` clears them for the next step.

    `buffer` may be given (the distributed optimizer lays out its own grad buffer); `offsets`
    then says where each parameter's gradient starts in it.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        dtype: torch.dtype,
        buffer: Optional[torch.Tensor] = None,
        offsets: Optional[Sequence[int]] = None,
    ) -> None:
        self.params: List[nn.Parameter] = list(params)
        if offsets is None:
            offsets, total = [], 0
            for param in self.params:
                offsets.append(total)
                total += param.numel()
        else:
            total = max((o + p.numel() for o, p in zip(offsets, self.params)), default=0)
        if buffer is None:
            device = self.params[0].device if self.params else torch.device("cpu")
            buffer = torch.zeros(total, dtype=dtype, device=device)
        self.buffer = buffer
        for param, offset in zip(self.params, offsets):
            param.main_grad = buffer[offset : offset + param.numel()].view_as(param)
            param.register_post_accumulate_grad_hook(_add_to_main_grad)

    def zero(self) -> None:
        """Clear every main gradient (and any `.grad` a backward left behind)."""
        self.buffer.zero_()
        for param in self.params:
            param.grad = None


def attach_main_grads(params: Sequence[nn.Parameter], dtype: torch.dtype) -> List[MainGradBuffer]:
    """Main gradients of `dtype` for `params`, one buffer per device; see the module docstring."""
    by_device: dict = {}
    for param in params:
        by_device.setdefault(param.device, []).append(param)
    return [MainGradBuffer(group, dtype) for group in by_device.values()]
