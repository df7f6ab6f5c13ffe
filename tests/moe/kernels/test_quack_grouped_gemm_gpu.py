"""QuACK's grouped product (moe.kernels.quack_grouped_gemm.QUACK) on a Hopper or Blackwell GPU with
the quack-kernels package: the product and its gradients against fp64 with experts that get no
rows, and a compiled dMoE layer on it, one graph, against the same layer on torch._grouped_mm
(on Hopper; elsewhere our Triton kernels). Run with `pytest -m gpu tests/moe/kernels/
test_quack_grouped_gemm_gpu.py` where quack imports (the CPU suite covers the same ops against a
stand-in: tests/moe/test_quack_backend.py)."""

from __future__ import annotations

import pytest
import torch

from megatron.config import ModelConfig
from moe.config import MoEConfig
from moe.kernels.grouped_gemm import (
    MOE,
    TORCH,
    grouped_mm_reference,
    grouped_product,
    torch_grouped_mm_is_fast_on,
)
from moe.kernels.quack_grouped_gemm import QUACK, quack_missing, quack_runs_on
from moe.layers import build_moe_layer
from tests.conftest import force_kernel_mode


def _why_not_here() -> str:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if not quack_runs_on(torch.device("cuda")):
        return "QuACK's kernels need an NVIDIA GPU of sm90 or newer"
    missing = quack_missing()
    return f"quack.gemm_interface does not import ({missing})" if missing else ""


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(_why_not_here()), reason=_why_not_here())]


@pytest.fixture(autouse=True)
def compiled_kernels(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    force_kernel_mode(monkeypatch, "auto")


def _relative_error(value: torch.Tensor, exact: torch.Tensor) -> float:
    return ((value.double() - exact.double()).norm() / exact.double().norm()).item()


def test_the_product_and_its_gradients_with_empty_experts_match_fp64():
    torch.manual_seed(0)
    tokens_per_expert = torch.tensor([300, 0, 120, 0, 77, 0, 500, 3], device="cuda")
    x = torch.randn(int(tokens_per_expert.sum()), 256, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(8, 256, 512, device="cuda", dtype=torch.bfloat16)
    grad_out = torch.randn(x.shape[0], 512, device="cuda", dtype=torch.bfloat16)
    x.requires_grad_()
    weight.requires_grad_()
    offsets = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
    out = grouped_product(x, weight, tokens_per_expert, offsets, QUACK)
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


def _layer(backend, num_experts: int, hidden: int, ffn: int, seq_length: int):
    model = ModelConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=hidden // 64, ffn_hidden_size=ffn,
        seq_length=seq_length, max_position_embeddings=seq_length, add_bias_linear=False,
        init_method_std=0.02,
    )  # fmt: skip
    moe = MoEConfig(num_experts=num_experts, top_k=2, mlp_impl="grouped", grouped_gemm=backend)
    torch.manual_seed(0)
    return build_moe_layer(model, moe).cuda().to(torch.bfloat16)


# dMoE-125M's layer (64 experts of 3072 at hidden 768) on 2 x 1024 tokens; then 32 tokens over 64
# experts at top-2, which leaves at least half of them without rows.
@pytest.mark.parametrize("tokens", [2048, 32], ids=["125m-layer", "empty-experts"])
def test_the_compiled_dmoe_layer_on_quack_matches_the_runs_other_grouped_gemm(tokens):
    device = torch.device("cuda")
    other = TORCH if torch_grouped_mm_is_fast_on(device) else MOE
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    torch.manual_seed(1)
    x = torch.randn(2, tokens // 2, 768, device="cuda").to(torch.bfloat16)
    results = []
    for backend in (other, QUACK):
        layer = _layer(backend, num_experts=64, hidden=768, ffn=3072, seq_length=tokens // 2)
        run = torch.compile(layer, fullgraph=True) if backend.compiles_whole else layer
        inputs = x.clone().requires_grad_()
        out = run(inputs)
        out.float().square().sum().backward()
        experts = layer.experts
        results.append(
            (out, inputs.grad, experts.w1.grad, experts.w2.grad, layer.tokens_per_expert.clone())
        )
    assert not counters["graph_break"]
    (*want, want_counts), (*got, counts) = results
    assert torch.equal(counts, want_counts)  # the same routing
    for name, value, expected in zip(("output", "input grad", "w1 grad", "w2 grad"), got, want):
        assert _relative_error(value, expected) < 2e-2, name
    empty = (counts == 0).nonzero().flatten().tolist()
    if tokens == 32:
        assert len(empty) >= 32
    for expert in empty:
        assert torch.count_nonzero(got[2][expert]) == 0 and torch.count_nonzero(got[3][expert]) == 0
