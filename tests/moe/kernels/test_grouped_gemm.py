"""grouped_mm: the Triton kernels (run by Triton's CPU interpreter) against the reference."""

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron.kernels.dispatch import TRITON_AVAILABLE  # noqa: E402
from moe.kernels import grouped_gemm  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed"),
    pytest.mark.usefixtures("triton_kernels"),
]

TILES = grouped_gemm.TileSizes(block_m=16, block_n=16, block_k=16)


@pytest.fixture
def triton_only(monkeypatch):
    """Fail the test if any product falls back to the reference instead of the Triton kernels."""
    reference = grouped_gemm.grouped_mm_reference

    def refuse(*args, **kwargs):
        raise AssertionError("grouped_mm fell back to its reference instead of the Triton kernel")

    monkeypatch.setattr(grouped_gemm, "grouped_mm_reference", refuse)
    monkeypatch.setattr(grouped_gemm, "_weight_grad_reference", refuse)
    return reference


def _random_tokens_per_expert(generator, num_experts, zero_experts):
    counts = torch.randint(1, 20, (num_experts,), generator=generator)
    counts[list(zero_experts)] = 0
    return counts


def _run(fn, x, weight, tokens_per_expert, grad_out):
    x = x.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    out = fn(x, weight, tokens_per_expert)
    out.backward(grad_out)
    return out.detach(), x.grad, weight.grad


def _assert_close(actual, expected, rtol):
    # Relative to the tensor's scale: per-element relative error is meaningless near zero.
    scale = expected.abs().max().clamp_min(1e-6)
    error = (actual.double() - expected.double()).abs().max() / scale
    assert error <= rtol, f"relative error {error:.2e} > {rtol:.0e}"


CASES = [
    # (num_experts, in_features K, out_features N, experts with no rows)
    (1, 16, 32, ()),
    (3, 48, 16, (1,)),
    (3, 32, 48, (0, 2)),
    (8, 16, 48, (0, 3, 7)),
    (8, 48, 32, (2, 5)),
]


# 32-wide tiles leave partial column tiles at 16 and 48 features (wrapped loads, masked stores).
@pytest.mark.parametrize("tiles", [TILES, grouped_gemm.TileSizes(32, 32, 32)], ids=["16", "32"])
@pytest.mark.parametrize("num_experts,in_features,out_features,zero_experts", CASES)
def test_triton_matches_reference_fp32(
    triton_only, tiles, num_experts, in_features, out_features, zero_experts
):
    reference = triton_only
    generator = torch.Generator().manual_seed(num_experts * 1000 + in_features + out_features)
    tokens_per_expert = _random_tokens_per_expert(generator, num_experts, zero_experts)
    rows = int(tokens_per_expert.sum())
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(num_experts, in_features, out_features, generator=generator)
    grad_out = torch.randn(rows, out_features, generator=generator)

    def triton_fn(x, weight, tokens_per_expert):
        return grouped_gemm.grouped_mm(x, weight, tokens_per_expert, tile_sizes=tiles)

    actual = _run(triton_fn, x, weight, tokens_per_expert, grad_out)
    expected = _run(reference, x, weight, tokens_per_expert, grad_out)
    for got, want in zip(actual, expected):
        assert got.shape == want.shape and got.dtype == want.dtype
        _assert_close(got, want, rtol=1e-4)
    for expert in zero_experts:
        assert torch.equal(actual[2][expert], torch.zeros(in_features, out_features))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_half_precision_matches_fp64_reference(triton_only, dtype):
    reference = triton_only
    generator = torch.Generator().manual_seed(7)
    tokens_per_expert = torch.tensor([9, 0, 21])
    x = torch.randn(30, 32, generator=generator)
    weight = torch.randn(3, 32, 48, generator=generator)
    grad_out = torch.randn(30, 48, generator=generator)

    def triton_fn(x, weight, tokens_per_expert):
        return grouped_gemm.grouped_mm(x, weight, tokens_per_expert, tile_sizes=TILES)

    actual = _run(triton_fn, x.to(dtype), weight.to(dtype), tokens_per_expert, grad_out.to(dtype))
    # The fp64 reference sees the same rounded inputs, so only accumulation and output rounding differ.
    expected = _run(
        reference,
        x.to(dtype).double(),
        weight.to(dtype).double(),
        tokens_per_expert,
        grad_out.to(dtype).double(),
    )
    for got, want in zip(actual, expected):
        assert got.dtype == dtype
        _assert_close(got, want, rtol=1e-2)


def test_triton_handles_no_rows_and_noncontiguous_inputs(triton_only):
    weight = torch.randn(3, 16, 32, requires_grad=True)
    empty = torch.zeros(0, 16, requires_grad=True)
    out = grouped_gemm.grouped_mm(
        empty, weight, torch.zeros(3, dtype=torch.int64), tile_sizes=TILES
    )
    assert out.shape == (0, 32)
    out.sum().backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight))
    assert empty.grad.shape == (0, 16)

    # Transposed views of x and weight, tokens_per_expert as int32.
    reference = triton_only
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(16, 25, generator=generator).t()
    weight = torch.randn(2, 32, 16, generator=generator).transpose(1, 2)
    tokens_per_expert = torch.tensor([12, 13], dtype=torch.int32)
    got = grouped_gemm.grouped_mm(x, weight, tokens_per_expert, tile_sizes=TILES)
    _assert_close(got, reference(x, weight, tokens_per_expert), rtol=1e-4)


def test_grouped_product_on_torch_grouped_mm(reference_kernels):
    """grouped_product with torch._grouped_mm (torch's CPU kernel here): all three products
    equal the reference, the experts without rows get a zero weight gradient; no rows at all
    take the op, whose weight gradient torch's does not give (pytorch/pytorch#192497)."""
    if not grouped_gemm.torch_has_grouped_mm():
        pytest.skip("this torch has no torch._grouped_mm")
    generator = torch.Generator().manual_seed(11)
    tokens_per_expert = torch.tensor([7, 0, 12, 5])
    offsets = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
    x = torch.randn(24, 32, generator=generator)
    weight = torch.randn(4, 32, 48, generator=generator)
    grad_out = torch.randn(24, 48, generator=generator)

    def product(x, weight, tokens_per_expert):
        return grouped_gemm.grouped_product(
            x, weight, tokens_per_expert, offsets, grouped_gemm.TORCH
        )

    actual = _run(product, x, weight, tokens_per_expert, grad_out)
    expected = _run(grouped_gemm.grouped_mm_reference, x, weight, tokens_per_expert, grad_out)
    for got, want in zip(actual, expected):
        assert got.shape == want.shape
        _assert_close(got, want, rtol=1e-5)
    assert torch.equal(actual[2][1], torch.zeros(32, 48))
    empty = torch.zeros(0, 32, requires_grad=True)
    none = torch.zeros(4, dtype=torch.int64)
    weight = weight.requires_grad_()
    out = grouped_gemm.grouped_product(empty, weight, none, none.int(), grouped_gemm.TORCH)
    out.sum().backward()
    assert out.shape == (0, 48) and torch.equal(weight.grad, torch.zeros_like(weight))


def test_reference_mode_uses_reference(reference_kernels, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a Triton kernel ran in reference mode")

    monkeypatch.setattr(grouped_gemm, "_grouped_mm_triton", refuse)
    monkeypatch.setattr(grouped_gemm, "_weight_grad_triton", refuse)
    x = torch.randn(5, 16, requires_grad=True)
    weight = torch.randn(2, 16, 16)
    tokens_per_expert = torch.tensor([2, 3])
    got = grouped_gemm.grouped_mm(x, weight, tokens_per_expert)
    got.sum().backward()
    torch.testing.assert_close(got, grouped_gemm.grouped_mm_reference(x, weight, tokens_per_expert))


def test_shape_errors_say_what_was_wrong():
    with pytest.raises(ValueError, match="weight \\[E, K, N\\]"):
        grouped_gemm.grouped_mm(torch.randn(4, 8), torch.randn(2, 16, 8), torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="tokens_per_expert of shape"):
        grouped_gemm.grouped_mm(torch.randn(4, 16), torch.randn(2, 16, 8), torch.tensor([4]))
    with pytest.raises(ValueError, match="one dtype"):
        grouped_gemm.grouped_mm(
            torch.randn(4, 16), torch.randn(2, 16, 8, dtype=torch.float64), torch.tensor([2, 2])
        )


@pytest.mark.parametrize(
    "width,accepted", [(8, True), (16, True), (24, True), (12, False), (20, False)]
)
def test_the_width_rule_of_choose_backend_matches_torch(width, accepted):
    """choose_backend takes torch._grouped_mm only for operand widths of whole 16 bytes: the
    rule torch's own check applies (run here by its CPU kernel) to bf16 rows."""
    assert (width * 2 % 16 == 0) is accepted
    if not grouped_gemm.torch_has_grouped_mm():
        pytest.skip("this torch has no torch._grouped_mm")
    x = torch.randn(8, width).to(torch.bfloat16)
    weight = torch.randn(2, width, 16).to(torch.bfloat16)
    offsets = torch.tensor([3, 8], dtype=torch.int32)
    try:
        torch._grouped_mm(x, weight, offs=offsets)
    except NotImplementedError:
        pytest.skip("this torch has no CPU torch._grouped_mm to compare with")
    except RuntimeError as error:
        assert not accepted, f"torch rejected a width the rule accepts: {error}"
    else:
        assert accepted, "torch accepted a width the rule rejects"


def test_rows_past_the_groups_are_in_no_product(triton_only):
    """Expert-parallel padding (moe.exchange.fixed_blocks): rows past the groups' total change no
    weight gradient, and the kernels write neither their outputs nor their input gradients
    (the reference writes zeros there)."""
    reference = triton_only
    generator = torch.Generator().manual_seed(11)
    tokens_per_expert = torch.tensor([5, 0, 9])
    real, padding = 14, 10
    x = torch.randn(real + padding, 16, generator=generator)
    weight = torch.randn(3, 16, 24, generator=generator)
    grad_out = torch.randn(real + padding, 24, generator=generator)
    filled = torch.full((real + padding, 24), float("nan"))
    grouped_gemm._grouped_mm_triton(
        x, weight, tokens_per_expert, transpose_weight=False, tile_sizes=TILES, out=filled
    )
    assert torch.isnan(filled[real:]).all() and not torch.isnan(filled[:real]).any()
    actual = _run(
        lambda x, w, t: grouped_gemm.grouped_mm(x, w, t, tile_sizes=TILES),
        x, weight, tokens_per_expert, grad_out,
    )  # fmt: skip
    expected = _run(reference, x, weight, tokens_per_expert, grad_out)
    without_padding = _run(reference, x[:real], weight, tokens_per_expert, grad_out[:real])
    _assert_close(actual[0][:real], expected[0][:real], rtol=1e-4)
    _assert_close(actual[1][:real], expected[1][:real], rtol=1e-4)
    _assert_close(actual[2], without_padding[2], rtol=1e-4)
    assert torch.equal(expected[0][real:], torch.zeros(padding, 24))
    assert torch.equal(expected[1][real:], torch.zeros(padding, 16))
