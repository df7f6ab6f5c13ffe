"""The FP8 grouped GEMM on a GPU with FP8 grouped products (torch._scaled_grouped_mm: NVIDIA
Hopper) at a real shape: the CUTLASS kernel against the expert-by-expert reference, eager and
compiled as one graph."""

from __future__ import annotations

import pytest
import torch

from megatron.kernels.fp8_linear import FP8_RECIPES, Fp8Recipe
from moe.kernels.fp8_grouped_gemm import fp8_grouped_mm, fp8_grouped_reference
from moe.kernels.grouped_gemm import torch_grouped_mm_is_fast_on

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available()
        or not torch_grouped_mm_is_fast_on(torch.device("cuda"))
        or not hasattr(torch, "_scaled_grouped_mm"),
        reason="needs torch._scaled_grouped_mm's GPU (NVIDIA Hopper)",
    ),
]

# 8 experts, one empty, sizes that are not multiples of 16, 40 rows after the last group.
COUNTS = (517, 0, 1203, 64, 333, 981, 7, 726)
TRAILING = 40


def _relative_error(value: torch.Tensor, expected: torch.Tensor) -> float:
    return ((value.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("scaling", FP8_RECIPES)
def test_the_kernel_matches_the_reference(scaling, compiled):
    recipe = Fp8Recipe(scaling)
    generator = torch.Generator(device="cpu").manual_seed(0)
    rows, hidden, ffn = sum(COUNTS) + TRAILING, 1024, 1536
    x = torch.randn(rows, hidden, generator=generator).cuda().bfloat16().requires_grad_()
    weight = (0.02 * torch.randn(len(COUNTS), hidden, ffn, generator=generator)).cuda()
    weight.requires_grad_()
    grad_output = torch.randn(rows, ffn, generator=generator).cuda().bfloat16()
    offsets = torch.tensor(COUNTS).cumsum(0).to(torch.int32).cuda()
    op = torch.compile(fp8_grouped_mm, fullgraph=True) if compiled else fp8_grouped_mm
    y = op(x, weight, offsets, recipe)
    y.backward(grad_output)
    expected = fp8_grouped_reference(x.detach(), weight.detach(), grad_output, offsets, recipe)
    real = sum(COUNTS)
    for got, want in zip((y[:real], x.grad[:real], weight.grad), expected):
        assert _relative_error(got, want) < 2e-3
    assert torch.count_nonzero(weight.grad[1]) == 0
