"""The FP8 grouped GEMM (moe.kernels.fp8_grouped_gemm) against its expert-by-expert reference on
the CPU, where its products dequantize the same FP8 operands and multiply them in fp32: the
quantization, the scale layouts and the padded weight-gradient layout are all exercised; only
the CUTLASS kernel is not (tests/moe/kernels/test_fp8_grouped_gemm_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from megatron.kernels.fp8_linear import FP8_RECIPES, Fp8Recipe, TensorShard
from moe.kernels.fp8_grouped_gemm import fp8_grouped_mm, fp8_grouped_reference
from tests.launch import run_distributed
from tests.markers import needs_torch_grouped_mm

pytestmark = needs_torch_grouped_mm

# Groups of sizes that are not multiples of 16, an empty expert, and 3 rows after the last
# group (moe.exchange.fixed_blocks's padding), which every product leaves out.
COUNTS = (5, 0, 37, 18)
TRAILING = 3


def _operands(seed: int, weight_dtype=torch.float32, hidden: int = 32, ffn: int = 48):
    generator = torch.Generator().manual_seed(seed)
    rows = sum(COUNTS) + TRAILING
    x = torch.randn(rows, hidden, generator=generator).bfloat16().requires_grad_()
    weight = torch.randn(len(COUNTS), hidden, ffn, generator=generator)
    weight = weight.to(weight_dtype).requires_grad_()
    grad_output = torch.randn(rows, ffn, generator=generator).bfloat16()
    # The trailing rows' output gradient is whatever the unwritten output rows held.
    grad_output[sum(COUNTS) :] = float("nan")
    offsets = torch.tensor(COUNTS).cumsum(0).to(torch.int32)
    return x, weight, grad_output, offsets


def _exact(x, weight, grad_output):
    """(y, dx, dw) in fp32 without quantization, expert by expert."""
    bounds = [0, *torch.tensor(COUNTS).cumsum(0).tolist()]
    xs, gs = x.detach().float(), grad_output.float()
    pairs = list(zip(bounds[:-1], bounds[1:]))
    y = torch.cat([xs[a:b] @ weight[e].detach().float() for e, (a, b) in enumerate(pairs)])
    dx = torch.cat([gs[a:b] @ weight[e].detach().float().t() for e, (a, b) in enumerate(pairs)])
    dw = torch.stack([xs[a:b].t() @ gs[a:b] for a, b in pairs])
    return y, dx, dw


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", FP8_RECIPES)
def test_the_op_matches_its_reference(scaling, weight_dtype):
    recipe = Fp8Recipe(scaling)
    x, weight, grad_output, offsets = _operands(0, weight_dtype)
    y = fp8_grouped_mm(x, weight, offsets, recipe)
    y.backward(grad_output)
    expected_y, expected_dx, expected_dw = fp8_grouped_reference(
        x.detach(), weight.detach(), grad_output, offsets, recipe
    )
    rows = sum(COUNTS)
    assert y.dtype == torch.bfloat16 and x.grad.dtype == x.dtype
    assert weight.grad.dtype == weight_dtype
    # Both sides round fp32 sums to bf16: one bf16 step apart at most.
    torch.testing.assert_close(y[:rows], expected_y, rtol=8e-3, atol=1e-3)
    torch.testing.assert_close(x.grad[:rows], expected_dx, rtol=8e-3, atol=1e-3)
    torch.testing.assert_close(weight.grad, expected_dw, rtol=8e-3, atol=1e-3)
    assert torch.count_nonzero(weight.grad[1]) == 0  # the empty expert
    assert bool(torch.isfinite(weight.grad).all())  # the NaN rows were left out


@pytest.mark.parametrize("scaling", FP8_RECIPES)
def test_products_are_quantized_and_close_to_fp32(scaling):
    """Each product differs from the exact one (its operands were quantized) by what e4m3's 3
    mantissa bits allow."""
    x, weight, grad_output, offsets = _operands(1)
    y = fp8_grouped_mm(x, weight, offsets, Fp8Recipe(scaling))
    y.backward(grad_output)
    rows = sum(COUNTS)
    grad_output = grad_output[:rows]
    for got, exact in zip((y[:rows], x.grad[:rows], weight.grad), _exact(x, weight, grad_output)):
        error = ((got.float() - exact).norm() / exact.norm()).item()
        assert 1e-3 < error < 0.05, error


def test_rowwise_keeps_one_experts_outlier_out_of_the_others_weight_gradient():
    """A huge row in expert 0's tokens: with one scale per tensor it crushes every other row
    to a few FP8 steps; rowwise, the weight gradient's scales are per expert, so expert 2's
    stays accurate."""
    errors = {}
    for scaling in FP8_RECIPES:
        x, weight, grad_output, offsets = _operands(2)
        with torch.no_grad():
            x[0] *= 1e6
        fp8_grouped_mm(x, weight, offsets, Fp8Recipe(scaling)).backward(grad_output)
        exact = _exact(x, weight, grad_output[: sum(COUNTS)])[2][2]
        errors[scaling] = ((weight.grad[2] - exact).norm() / exact.norm()).item()
    assert errors["rowwise"] < 0.05 < errors["tensorwise"], errors


def _products(
    scaling: str, shard=None, x_columns=slice(None), weight_slice=(), grad_columns=slice(None)
):
    """(y, dx, dw) in fp32 of the op on `_operands(3)` (ffn 64), narrowed to a rank's slices."""
    x, weight, grad_output, offsets = _operands(3, ffn=64)
    x = x.detach()[:, x_columns].contiguous().requires_grad_()
    weight = weight.detach()[(slice(None), *weight_slice)].contiguous().requires_grad_()
    y = fp8_grouped_mm(x, weight, offsets, Fp8Recipe(scaling), shard=shard)
    y.backward(grad_output[:, grad_columns])
    rows = sum(COUNTS)
    return y[:rows].float(), x.grad[:rows].float(), weight.grad.float()


def _tensor_parallel_products(rank: int, world_size: int, scaling: str, dim: int) -> list:
    """One rank's share of the products with the weight split along `dim` (0: its output
    columns, as w1; 1: its input rows, as w2), assembled into the whole ones."""
    group = torch.distributed.group.WORLD
    shard = TensorShard(dim, group)
    output_share = slice(rank * 64 // world_size, (rank + 1) * 64 // world_size)
    input_share = slice(rank * 32 // world_size, (rank + 1) * 32 // world_size)
    if dim == 0:
        y, dx, dw = _products(scaling, shard, weight_slice=(slice(None), output_share),
                              grad_columns=output_share)  # fmt: skip
        torch.distributed.all_reduce(dx, group=group)
        return [_gathered(y, 1), dx, _gathered(dw, 2)]
    y, dx, dw = _products(scaling, shard, x_columns=input_share, weight_slice=(input_share,))
    torch.distributed.all_reduce(y, group=group)
    return [y, _gathered(dx, 1), _gathered(dw, 1)]


def _gathered(shard: torch.Tensor, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(shard) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, shard.contiguous())
    return torch.cat(parts, dim)


@pytest.mark.parametrize("dim", [0, 1], ids=["w1_split_by_outputs", "w2_split_by_inputs"])
@pytest.mark.parametrize("scaling", FP8_RECIPES)
def test_tensor_parallel_ranks_quantize_with_one_process_scales(scaling, dim):
    """Each rank holds a slice of every expert's ffn channels: with the amax of every split
    dimension reduced over the ranks, the assembled products are one process's, exactly where
    each rank writes whole values, and up to the bf16 rounding of the partial sums where the
    ranks' results are summed (each rank's own scales would differ by FP8 rounding, ~3%)."""
    expected = _products(scaling)
    products = run_distributed(_tensor_parallel_products, 2, scaling, dim)[0]
    summed = "dx" if dim == 0 else "y"
    for name, got, wanted in zip(["y", "dx", "dw"], products, expected):
        if name != summed:
            assert torch.equal(got, wanted), name
        error = ((got - wanted).norm() / wanted.norm()).item()
        assert error < 5e-3, (name, error)
