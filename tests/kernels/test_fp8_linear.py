"""FP8 linear products (megatron.kernels.fp8_linear) against their quantize-dequantize
reference, on the CPU's torch._scaled_mm."""

from __future__ import annotations

import pytest
import torch

from megatron.kernels.fp8_linear import (
    FP8_FORMATS,
    FP8_RECIPES,
    Fp8Recipe,
    fp8_linear,
    fp8_linear_reference,
)


def _cpu_scaled_mm() -> bool:
    one = torch.tensor(1.0)
    operand = torch.zeros(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(operand, operand.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True


pytestmark = pytest.mark.skipif(
    not _cpu_scaled_mm(), reason="this torch has no torch._scaled_mm on the CPU"
)


def _operands(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 8, 32, generator=generator, requires_grad=True)
    weight = torch.randn(48, 32, generator=generator, requires_grad=True)
    grad_output = torch.randn(4, 8, 48, generator=generator)
    return x, weight, grad_output


@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("scaling", FP8_RECIPES)
def test_the_op_matches_its_reference(scaling, fmt):
    recipe = Fp8Recipe(scaling, fmt)
    x, weight, grad_output = _operands()
    y = fp8_linear(x, weight, recipe)
    y.backward(grad_output)
    expected_y, expected_dx, expected_dw = fp8_linear_reference(
        x.detach(), weight.detach(), grad_output, recipe
    )
    torch.testing.assert_close(y, expected_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, expected_dx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad, expected_dw, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scaling", FP8_RECIPES)
def test_products_are_quantized_and_close_to_fp32(scaling):
    """Each product differs from the fp32 one (its operands were quantized) by what 3 mantissa
    bits allow."""
    x, weight, grad_output = _operands(1)
    y = fp8_linear(x, weight, Fp8Recipe(scaling))
    y.backward(grad_output)
    exact_y = x @ weight.t()
    exact_dx = grad_output @ weight
    exact_dw = grad_output.reshape(-1, 48).t() @ x.reshape(-1, 32)
    for got, exact in ((y, exact_y), (x.grad, exact_dx), (weight.grad, exact_dw)):
        relative = ((got - exact).norm() / exact.norm()).item()
        assert 0.0 < relative < 0.06, relative


def test_rowwise_scaling_keeps_an_outlier_row_to_itself():
    """A token 1e5 times larger than the others: one scale for the whole input crushes every other
    row toward zero; a scale per row does not."""
    x, weight, _ = _operands(2)
    x = x.detach().clone()
    x[0, 0] *= 1e5
    exact = x[0, 1:] @ weight.detach().t()
    errors = {}
    for scaling in FP8_RECIPES:
        y = fp8_linear(x, weight.detach(), Fp8Recipe(scaling))
        errors[scaling] = ((y[0, 1:] - exact).norm() / exact.norm()).item()
    assert errors["rowwise"] < 0.06 < errors["tensorwise"], errors


def test_formats_choose_their_dtypes_in_one_place():
    assert Fp8Recipe(format="e4m3").gradient_dtype == torch.float8_e4m3fn
    assert Fp8Recipe(format="hybrid").gradient_dtype == torch.float8_e5m2
    assert Fp8Recipe(format="hybrid").forward_dtype == torch.float8_e4m3fn
    rocm = Fp8Recipe(format="hybrid", fnuz=True)
    assert (rocm.forward_dtype, rocm.gradient_dtype) == (
        torch.float8_e4m3fnuz,
        torch.float8_e5m2fnuz,
    )
    with pytest.raises(ValueError, match="blockwise"):
        Fp8Recipe("blockwise")


@pytest.mark.parametrize("scaling", FP8_RECIPES)
def test_the_op_compiles_as_one_graph_and_agrees(scaling):
    """torch.compile traces the op whole (the amax, scale and cast fuse around each product)
    and meets _scaled_mm's operand layouts: the weight gradient's left operand is a transpose."""
    recipe = Fp8Recipe(scaling)
    results = []
    for run in (fp8_linear, torch.compile(fp8_linear, fullgraph=True)):
        x, weight, grad_output = _operands(3)
        run(x, weight, recipe).backward(grad_output)
        results.append((x.grad, weight.grad))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
