"""Gradient accumulation in fp32 from bf16/fp16 addends, one pass over memory:
`accumulate_(total, first, second)` (total += first + second, in place) and
`sum_in_fp32(first, second)` (a new fp32 tensor). moe.experts adds each micro-batch's expert
weight gradients into the fp32 gradients with them, two micro-batches per pass. The total may
also be bf16 (a bf16 main gradient, megatron.main_grads): the sum is then taken in fp32 and
rounded to bf16 once.

Why a kernel: torch's `total.add_(addend)` with mixed dtypes takes its non-vectorized
elementwise path on CUDA, well below the memory bandwidth this kernel reaches
(docs/benchmark-log.md).
Adding two addends in one pass reads 2 + 2 + 4 bytes and writes 4 per element, where two
separate passes move 20.
The kernel adds in fp32 in the reference's order, (total + first) + second, rounding after each
add as torch does, so kernel and reference agree bit for bit.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.kernels.dispatch import TRITON_AVAILABLE, use_triton

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from megatron.kernels.aot import AotSpec

__all__ = [
    "AOT_SPECS",
    "accumulate_",
    "sum_in_fp32",
    "accumulate_reference_",
    "sum_in_fp32_reference",
]

BLOCK = 4096


if TRITON_AVAILABLE:

    @triton.jit
    def _accumulate_kernel(
        total_ptr,
        first_ptr,
        second_ptr,
        numel,
        HAS_TOTAL: tl.constexpr,
        HAS_SECOND: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # int64 offsets: expert weight gradients exceed 2**31 elements at larger sizes.
        start = tl.program_id(0).to(tl.int64) * BLOCK
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < numel
        result = tl.load(first_ptr + offsets, mask=mask).to(tl.float32)
        if HAS_TOTAL:
            result = tl.load(total_ptr + offsets, mask=mask).to(tl.float32) + result
        if HAS_SECOND:
            result = result + tl.load(second_ptr + offsets, mask=mask).to(tl.float32)
        tl.store(total_ptr + offsets, result.to(total_ptr.dtype.element_ty), mask=mask)


def accumulate_reference_(
    total: torch.Tensor, first: torch.Tensor, second: Optional[torch.Tensor] = None
) -> torch.Tensor:
    if total.dtype != torch.float32:  # in fp32, rounded to the total's dtype once
        total.copy_(accumulate_reference_(total.float(), first, second))
        return total
    total.add_(first)
    if second is not None:
        total.add_(second)
    return total


def sum_in_fp32_reference(first: torch.Tensor, second: Optional[torch.Tensor] = None):
    total = first.to(torch.float32)
    if second is not None:
        total.add_(second)
    return total


def _addends_suit_kernel(
    shape: torch.Size, first: torch.Tensor, second: Optional[torch.Tensor]
) -> bool:
    """Whether the kernel can read the addends for a total of `shape`."""
    addends = [first] if second is None else [first, second]
    return (
        first.numel() > 0
        and all(addend.shape == shape and addend.is_contiguous() for addend in addends)
        and use_triton(*addends)
    )


def _launch(total, first, second, has_total: bool) -> None:
    numel = total.numel()
    _accumulate_kernel[(triton.cdiv(numel, BLOCK),)](
        total,
        first,
        first if second is None else second,
        numel,
        HAS_TOTAL=has_total,
        HAS_SECOND=second is not None,
        BLOCK=BLOCK,
    )


def accumulate_(
    total: torch.Tensor, first: torch.Tensor, second: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """total += first (+ second) in place, in fp32; returns total. The kernel runs for a
    contiguous fp32 or bf16 total and contiguous addends of its shape on the GPU; anything else
    goes to torch's add."""
    if not (
        total.dtype in (torch.float32, torch.bfloat16)
        and total.is_contiguous()
        and total.device == first.device
        and _addends_suit_kernel(total.shape, first, second)
    ):
        return accumulate_reference_(total, first, second)
    _launch(total, first, second, has_total=True)
    return total


def sum_in_fp32(first: torch.Tensor, second: Optional[torch.Tensor] = None) -> torch.Tensor:
    """first (+ second) as a new fp32 tensor (the first micro-batches' gradient)."""
    if not _addends_suit_kernel(first.shape, first, second):
        return sum_in_fp32_reference(first, second)
    total = torch.empty(first.shape, dtype=torch.float32, device=first.device)
    _launch(total, first, second, has_total=False)
    return total


AOT_SPECS = (
    [
        AotSpec(
            kernel=_accumulate_kernel,
            signature={
                "total_ptr": "*fp32",
                "first_ptr": f"*{dtype}",
                "second_ptr": f"*{dtype}",
                "numel": "i64",
            },
            constexprs={"HAS_TOTAL": has_total, "HAS_SECOND": has_second, "BLOCK": BLOCK},
        )
        for dtype in ("bf16", "fp16")
        for has_total in (True, False)
        for has_second in (True, False)
    ]
    + [
        AotSpec(
            kernel=_accumulate_kernel,
            signature={
                "total_ptr": "*bf16",
                "first_ptr": "*bf16",
                "second_ptr": "*bf16",
                "numel": "i64",
            },
            constexprs={"HAS_TOTAL": True, "HAS_SECOND": has_second, "BLOCK": BLOCK},
        )
        for has_second in (True, False)
    ]
    if TRITON_AVAILABLE
    else []
)
