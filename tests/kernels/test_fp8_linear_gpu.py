"""The FP8 linear products on a GPU with FP8 tensor cores at a real shape: torch._scaled_mm's
kernels against the quantize-dequantize reference, eager and compiled as one graph."""

from __future__ import annotations

import pytest
import torch

from megatron.kernels.fp8_linear import (
    FP8_FORMATS,
    FP8_RECIPES,
    Fp8Recipe,
    fp8_linear,
    fp8_linear_reference,
    fp8_unsupported,
    recipe_for,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or fp8_unsupported(torch.device("cuda")) is not None,
        reason="needs a GPU with FP8 tensor cores",
    ),
]


def _relative_error(value: torch.Tensor, expected: torch.Tensor) -> float:
    return ((value.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("scaling", FP8_RECIPES)
def test_the_kernels_match_the_reference(scaling, fmt, compiled):
    device = torch.device("cuda")
    recipe = recipe_for(device, scaling, fmt)
    assert recipe == Fp8Recipe(scaling, fmt, recipe.fnuz)
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(4, 1000, 1024, generator=generator).to(device, torch.bfloat16)
    x.requires_grad_()
    weight = (0.02 * torch.randn(1536, 1024, generator=generator)).to(device).requires_grad_()
    grad_output = torch.randn(4, 1000, 1536, generator=generator).to(device, torch.bfloat16)
    op = torch.compile(fp8_linear, fullgraph=True) if compiled else fp8_linear
    y = op(x, weight, recipe)
    y.backward(grad_output)
    expected = fp8_linear_reference(x.detach(), weight.detach(), grad_output, recipe)
    for got, want in zip((y, x.grad, weight.grad), expected):
        assert _relative_error(got, want) < 2e-3
