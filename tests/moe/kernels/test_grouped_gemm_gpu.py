"""grouped_mm on a GPU at a real shape: each fast path (torch._grouped_mm, Triton, QuACK where
quack-kernels is installed on an sm90+ GPU) against fp64."""

import pytest
import torch

from moe.kernels.grouped_gemm import MOE, TORCH, grouped_mm_reference, grouped_product
from moe.kernels.quack_grouped_gemm import QUACK
from tests.conftest import force_kernel_mode, why_quack_cannot_run_here

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]


def _relative_error(value, exact):
    return ((value.double() - exact).norm() / exact.norm()).item()


# The grouped products a run may choose: torch._grouped_mm (bf16 on Hopper), our Triton kernels
# with the tiles default_tile_sizes picks for the GPU (200 x 328 leaves partial tiles: wrapped
# loads), and QuACK's (--moe-grouped-gemm-kernel quack).
@pytest.mark.parametrize(
    "backend,dtype,in_features,out_features",
    [
        (TORCH, torch.bfloat16, 256, 512),
        (MOE, torch.bfloat16, 256, 512),
        (MOE, torch.float16, 200, 328),
        pytest.param(
            QUACK,
            torch.bfloat16,
            256,
            512,
            marks=pytest.mark.skipif(
                bool(why_quack_cannot_run_here()), reason=why_quack_cannot_run_here()
            ),
        ),
    ],
    ids=["torch-bf16", "ours-bf16", "ours-fp16-partial-tiles", "quack-bf16"],
)
def test_grouped_product_with_empty_experts_matches_fp64(
    monkeypatch, backend, dtype, in_features, out_features
):
    force_kernel_mode(monkeypatch, "triton" if backend == MOE else "auto")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch.manual_seed(0)
    tokens_per_expert = torch.tensor([300, 0, 120, 0, 77, 0, 500, 3], device="cuda")
    x = torch.randn(int(tokens_per_expert.sum()), in_features, device="cuda", dtype=dtype)
    weight = torch.randn(8, in_features, out_features, device="cuda", dtype=dtype)
    grad_out = torch.randn(x.shape[0], out_features, device="cuda", dtype=dtype)
    x.requires_grad_()
    weight.requires_grad_()
    offsets = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
    out = grouped_product(x, weight, tokens_per_expert, offsets, backend)
    out.backward(grad_out)
    x64 = x.detach().double().requires_grad_()
    weight64 = weight.detach().double().requires_grad_()
    out64 = grouped_mm_reference(x64, weight64, tokens_per_expert)
    out64.backward(grad_out.double())
    assert _relative_error(out, out64) < 1e-2
    assert _relative_error(x.grad, x64.grad) < 1e-2
    assert _relative_error(weight.grad, weight64.grad) < 1e-2
    for expert in (1, 3, 5):  # no rows: the weight gradient must be exactly zero, not stale
        assert torch.count_nonzero(weight.grad[expert]) == 0
