"""The persistent TMA grouped GEMM of bench/kernels on a GPU at a real shape, against fp64."""

import pytest
import torch

from bench.kernels import grouped_gemm_tma
from moe.kernels.grouped_gemm import grouped_mm_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]


def _relative_error(value, exact):
    return ((value.double() - exact).norm() / exact.norm()).item()


@pytest.mark.skipif(
    not torch.cuda.is_available()
    or torch.version.hip is not None
    or torch.cuda.get_device_capability()[0] < 9,
    reason="the TMA grouped GEMM needs an NVIDIA GPU with TMA (Hopper or newer)",
)
@pytest.mark.parametrize("gather", [False, True])
def test_tma_grouped_gemm_matches_fp64(gather):
    """bench.kernels.grouped_gemm_tma at a real shape (rows of 8 experts, empty ones among them,
    partial row tiles), forward, input-gradient and weight-gradient products, plain and with
    the row operand gathered, against fp64."""
    if not grouped_gemm_tma.available():
        pytest.skip("this Triton has no device-side tensor descriptors")
    torch.manual_seed(0)
    counts = torch.tensor([300, 0, 1200, 0, 77, 0, 500, 3], device="cuda")
    rows, tokens, k, n = int(counts.sum()), 1500, 512, 1024
    index = torch.randint(0, tokens, (rows,), device="cuda") if gather else None
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens if gather else rows, k, **bf16)
    weight = torch.randn(8, k, n, **bf16)
    grad_out = torch.randn(rows, n, **bf16)
    x_rows = (x[index] if gather else x).double()
    out = grouped_gemm_tma.grouped_mm_tma(x, weight, counts, row_index=index)
    exact = grouped_mm_reference(x_rows, weight.double(), counts)
    assert _relative_error(out, exact) < 1e-2
    grad_rows = grouped_gemm_tma.grouped_mm_tma(grad_out, weight, counts, transpose_weight=True)
    exact = grouped_mm_reference(grad_out.double(), weight.double().transpose(1, 2), counts)
    assert _relative_error(grad_rows, exact) < 1e-2
    grad_weight = grouped_gemm_tma.weight_grad_tma(
        x, grad_out, counts, row_index=index, gather="x" if gather else None
    )
    exact = torch.stack(
        [part_x.t() @ part_g for part_x, part_g in zip(
            x_rows.split(counts.tolist()), grad_out.double().split(counts.tolist())
        )]
    )  # fmt: skip
    assert _relative_error(grad_weight, exact) < 1e-2
    for expert in (1, 3, 5):
        assert torch.count_nonzero(grad_weight[expert]) == 0
