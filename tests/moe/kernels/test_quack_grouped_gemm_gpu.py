"""QuACK's grouped product (moe.kernels.quack_grouped_gemm.QUACK) on a Hopper or Blackwell GPU with
the quack-kernels package: a compiled dMoE layer on it, one graph, against the same layer on
torch._grouped_mm (on Hopper; elsewhere our Triton kernels). The product and its gradients
against fp64 are test_grouped_gemm_gpu.py's quack-bf16 case; the CPU suite covers the same ops
against a stand-in (tests/moe/test_quack_backend.py)."""

from __future__ import annotations

import pytest
import torch

from megatron.config import ModelConfig
from moe.config import MoEConfig
from moe.kernels.grouped_gemm import MOE, TORCH, torch_grouped_mm_is_fast_on
from moe.kernels.quack_grouped_gemm import QUACK
from moe.layers import build_moe_layer
from tests.conftest import force_kernel_mode, why_quack_cannot_run_here

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(why_quack_cannot_run_here()), reason=why_quack_cannot_run_here()),
]


def _relative_error(value: torch.Tensor, exact: torch.Tensor) -> float:
    return ((value.double() - exact.double()).norm() / exact.double().norm()).item()


def _layer(backend, num_experts: int, hidden: int, ffn: int, seq_length: int):
    model = ModelConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=hidden // 64, ffn_hidden_size=ffn,
        seq_length=seq_length, max_position_embeddings=seq_length, add_bias_linear=False,
        init_method_std=0.02,
    )  # fmt: skip
    moe = MoEConfig(num_experts=num_experts, top_k=2, mlp_impl="grouped", grouped_gemm=backend)
    torch.manual_seed(0)
    return build_moe_layer(model, moe).cuda().to(torch.bfloat16)


# dMoE-125M's layer (64 experts of 3072 at hidden 768) on 2 x 1024 tokens; then 16 tokens over 64
# experts at top-2: 32 assignments, so at least 32 experts get no rows.
@pytest.mark.parametrize("tokens", [2048, 16], ids=["125m-layer", "empty-experts"])
def test_the_compiled_dmoe_layer_on_quack_matches_the_runs_other_grouped_gemm(tokens, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    force_kernel_mode(monkeypatch, "auto")
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
    if tokens == 16:
        assert len(empty) >= 32
    for expert in empty:
        assert torch.count_nonzero(got[2][expert]) == 0 and torch.count_nonzero(got[3][expert]) == 0


def test_quacks_weight_gradient_is_zero_for_experts_without_rows():
    """moe_quack::grouped_mm_weight_grad zeroes no expert itself: QuACK's varlen-K kernel writes an
    empty group's output. The op gets the block of NaN just freed (asserted), so an expert it left
    unwritten would read NaN."""
    experts, k, n, rows = 8, 256, 512, 64
    tokens_per_expert = torch.tensor([rows, 0] * (experts // 2), device="cuda")
    cu_seqlens = torch.nn.functional.pad(
        torch.cumsum(tokens_per_expert, 0, dtype=torch.int32), (1, 0)
    )
    torch.manual_seed(0)
    x = torch.randn(int(tokens_per_expert.sum()), k, device="cuda").to(torch.bfloat16)
    grad_out = torch.randn(x.shape[0], n, device="cuda").to(torch.bfloat16)
    dirty = torch.full((experts, k, n), torch.nan, dtype=torch.bfloat16, device="cuda")
    dirty_address = dirty.data_ptr()
    del dirty
    grad_weight = torch.ops.moe_quack.grouped_mm_weight_grad(x, grad_out, cu_seqlens)
    assert grad_weight.data_ptr() == dirty_address  # the premise: the op wrote into the NaN
    assert torch.count_nonzero(grad_weight[1::2]) == 0
    for expert, start in enumerate(range(0, x.shape[0], rows)):
        exact = x[start : start + rows].double().T @ grad_out[start : start + rows].double()
        assert _relative_error(grad_weight[2 * expert], exact) < 1e-2
