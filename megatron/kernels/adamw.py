"""One AdamW step on fp32 weights whose gradient and moments may be bf16, in fp32, one pass:
`adamw_step_(param, grad, exp_avg, exp_avg_sq, hyper)` (megatron/optimizer/precision.py).

Why a kernel: the reference upcasts the gradient and both moments of a chunk to fp32, updates
them with torch's formula and rounds the moments back, about 58 bytes of memory traffic per
weight for bf16 states; the kernel reads the weight (4), gradient and moments (2 each) and
writes the weight and moments: 18 bytes, fewer than torch's fused fp32 AdamW moves (28).

The kernel computes the reference's formula (torch's single-tensor AdamW) in fp32: decoupled
weight decay first, `exp_avg` lerped towards the gradient, `exp_avg_sq` decayed plus the
squared gradient, then the bias-corrected step; the moments are rounded to their dtype to
nearest-even. It differs from the reference only by fused multiply-adds (a few fp32 ulps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron.kernels.dispatch import TRITON_AVAILABLE, use_triton

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from megatron.kernels.aot import AotSpec

__all__ = [
    "AOT_SPECS",
    "AdamWHyper",
    "STEP_CHUNK",
    "adamw_step_",
    "adamw_step_reference_",
    "chunked_fp32_step_",
]

BLOCK = 2048
# Elements the reference upcasts at a time: its fp32 temporaries stay below 1 GiB however large
# a weight is (megatron.memory_plan counts them).
STEP_CHUNK = 2**26


@dataclass(frozen=True)
class AdamWHyper:
    """One step's hyper-parameters; `step` counts from 1."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int

    @property
    def step_size(self) -> float:
        return self.lr / (1.0 - self.beta1**self.step)

    @property
    def bias_correction2_sqrt(self) -> float:
        return math.sqrt(1.0 - self.beta2**self.step)


if TRITON_AVAILABLE:

    @triton.jit
    def _adamw_kernel(
        param_ptr,
        grad_ptr,
        exp_avg_ptr,
        exp_avg_sq_ptr,
        numel,
        decay,
        one_minus_beta1,
        beta2,
        one_minus_beta2,
        step_size,
        bias_correction2_sqrt,
        eps,
        BLOCK: tl.constexpr,
    ):
        start = tl.program_id(0).to(tl.int64) * BLOCK
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < numel
        param = tl.load(param_ptr + offsets, mask=mask)
        grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
        exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask).to(tl.float32)
        exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask).to(tl.float32)
        param = param * decay
        exp_avg = exp_avg + one_minus_beta1 * (grad - exp_avg)
        exp_avg_sq = exp_avg_sq * beta2 + one_minus_beta2 * (grad * grad)
        # IEEE square root and division (the defaults are approximate), as torch computes them.
        denom = tl.div_rn(tl.sqrt_rn(exp_avg_sq), bias_correction2_sqrt) + eps
        param = param - step_size * tl.div_rn(exp_avg, denom)
        tl.store(param_ptr + offsets, param, mask=mask)
        tl.store(exp_avg_ptr + offsets, exp_avg.to(exp_avg_ptr.dtype.element_ty), mask=mask)
        tl.store(
            exp_avg_sq_ptr + offsets, exp_avg_sq.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask
        )


def fp32_adamw_step_(param, grad, exp_avg, exp_avg_sq, hyper: AdamWHyper) -> None:
    """torch's single-tensor AdamW on fp32 tensors, in place."""
    param.mul_(1.0 - hyper.lr * hyper.weight_decay)
    exp_avg.lerp_(grad, 1.0 - hyper.beta1)
    exp_avg_sq.mul_(hyper.beta2).addcmul_(grad, grad, value=1.0 - hyper.beta2)
    denom = (exp_avg_sq.sqrt() / hyper.bias_correction2_sqrt).add_(hyper.eps)
    param.addcdiv_(exp_avg, denom, value=-hyper.step_size)


def chunked_fp32_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hyper: AdamWHyper,
    fp32_step: Callable[..., None] = fp32_adamw_step_,
    scratch: Optional[torch.Tensor] = None,
) -> None:
    """`fp32_step(param, grad, exp_avg, exp_avg_sq, hyper)` on `STEP_CHUNK` elements at a time,
    the gradient and the moments upcast to fp32 (into `scratch`, 3 x STEP_CHUNK fp32 elements,
    when given) and the moments rounded back to their dtypes."""
    flat = [t.view(-1) for t in (param, grad, exp_avg, exp_avg_sq)]
    for start in range(0, param.numel(), STEP_CHUNK):
        param_c, *sources = (t[start : start + STEP_CHUNK] for t in flat)
        size = param_c.numel()
        upcast = []
        for index, source in enumerate(sources):
            if source.dtype == torch.float32:
                upcast.append(source)
            elif scratch is None:
                upcast.append(source.float())
            else:
                upcast.append(scratch[index * size : (index + 1) * size].copy_(source))
        fp32_step(param_c, *upcast, hyper)
        for source, target in zip(sources[1:], upcast[1:]):
            if target is not source:
                source.copy_(target)


def adamw_step_reference_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hyper: AdamWHyper,
) -> None:
    """The step in PyTorch: torch's single-tensor AdamW, `STEP_CHUNK` elements at a time, the
    gradient and the moments upcast to fp32 and the moments rounded back to their dtypes."""
    chunked_fp32_step_(param, grad, exp_avg, exp_avg_sq, hyper)


def _suits_kernel(param, grad, exp_avg, exp_avg_sq) -> bool:
    tensors = (param, grad, exp_avg, exp_avg_sq)
    return (
        param.dtype == torch.float32
        and param.numel() > 0
        and all(t.is_contiguous() and t.numel() == param.numel() for t in tensors)
        and all(t.dtype in (torch.float32, torch.bfloat16) for t in tensors)
        and use_triton(*tensors)
    )


def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hyper: AdamWHyper,
) -> None:
    """One AdamW step in place on an fp32 `param` with `grad`, `exp_avg`, `exp_avg_sq` in fp32
    or bf16 (each its own): the Triton kernel for contiguous GPU tensors, else the reference."""
    if not _suits_kernel(param, grad, exp_avg, exp_avg_sq):
        adamw_step_reference_(param, grad, exp_avg, exp_avg_sq, hyper)
        return
    numel = param.numel()
    _adamw_kernel[(triton.cdiv(numel, BLOCK),)](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        numel,
        1.0 - hyper.lr * hyper.weight_decay,
        1.0 - hyper.beta1,
        hyper.beta2,
        1.0 - hyper.beta2,
        hyper.step_size,
        hyper.bias_correction2_sqrt,
        hyper.eps,
        BLOCK=BLOCK,
    )


AOT_SPECS = (
    [
        AotSpec(
            kernel=_adamw_kernel,
            signature={
                "param_ptr": "*fp32",
                "grad_ptr": f"*{grad}",
                "exp_avg_ptr": f"*{avg}",
                "exp_avg_sq_ptr": f"*{avg_sq}",
                "numel": "i64",
                **{
                    name: "fp32"
                    for name in (
                        "decay",
                        "one_minus_beta1",
                        "beta2",
                        "one_minus_beta2",
                        "step_size",
                        "bias_correction2_sqrt",
                        "eps",
                    )
                },
            },
            constexprs={"BLOCK": BLOCK},
        )
        for grad in ("fp32", "bf16")
        for avg in ("fp32", "bf16")
        for avg_sq in ("fp32", "bf16")
    ]
    if TRITON_AVAILABLE
    else []
)
