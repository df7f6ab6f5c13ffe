"""Compute-dtype copies of fp32 expert weights and how their gradients reach the fp32 weights
(moe.experts.Experts.refresh_compute_weights owns the copies; docs/moe.md, "Mixed precision").

- `CachedCast`: the copy stands in for autocast's cast in the autograd graph; the gradient
  reaches the fp32 weight through autograd, cast and accumulated as the cast's would be.
- `GradientAccumulator`: the copy is an autograd leaf and this is its post-accumulate-grad hook;
  it adds the copy's gradients into the fp32 weight's `.grad` itself, two micro-batches per
  fused pass (megatron.kernels.accumulate), bit for bit as autograd would; or, where the weight
  has a bf16 main gradient (`--main-grads-dtype bf16`, megatron.main_grads), into that, two
  micro-batches per pass as well, added in fp32 and rounded once.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron.kernels.accumulate import accumulate_, sum_in_fp32
from megatron.main_grads import gradient_written


class CachedCast(torch.autograd.Function):
    """A weight in the compute dtype, taken from its refreshed copy instead of cast again;
    backward sends the gradient to the weight as the cast's backward would (in its dtype)."""

    @staticmethod
    def forward(ctx, weight, copy):
        ctx.dtype = weight.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


class GradientAccumulator:
    """The post-accumulate-grad hook of a compute-dtype copy: adds the copy's gradients into its
    fp32 weight's `.grad`, or its bf16 `main_grad` where it has one, two micro-batches per pass
    (megatron.kernels.accumulate).

    The gradient of an odd micro-batch is held until the next one, so the pass over the
    accumulated gradient (8 of 10 bytes of traffic per weight in fp32, 4 of 6 in bf16) is paid
    once per two micro-batches; the held gradient costs 2 bytes per weight. `flush` adds a gradient still held, and must run
    before anything reads the weight's gradient (moe.experts.flush_expert_gradients).
    """

    def __init__(self, weight: nn.Parameter) -> None:
        self.weight = weight
        self.held: Optional[torch.Tensor] = None

    def __call__(self, copy: torch.Tensor) -> None:
        grad, copy.grad = copy.grad, None
        if self.held is None:
            self.held = grad
            return
        held, self.held = self.held, None
        self._add(held, grad)

    def flush(self) -> None:
        if self.held is not None:
            held, self.held = self.held, None
            self._add(held, None)

    def _add(self, first: torch.Tensor, second: Optional[torch.Tensor]) -> None:
        main_grad = getattr(self.weight, "main_grad", None)
        if main_grad is not None:
            # A bf16 main gradient (megatron.main_grads): the pair is added in fp32 and rounded
            # once, in one pass over it.
            accumulate_(main_grad, first, second)
        elif self.weight.grad is None:
            self.weight.grad = sum_in_fp32(first, second)
        else:
            accumulate_(self.weight.grad, first, second)
        # Whatever reduces the gradient as soon as it is written (the distributed optimizer's
        # overlapped reduce-scatter) learns of it as of autograd's accumulation.
        gradient_written(self.weight)
