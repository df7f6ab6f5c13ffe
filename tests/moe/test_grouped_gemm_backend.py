"""The dMoE's grouped GEMM is a record (moe.kernels.grouped_gemm.GroupedGemmBackend) that a run
asks, never a name that it compares: a backend the project has not met is compiled whole, given
FP8 products and multiplied with exactly as its record says, and one that carries torch's name
without torch's properties gets neither; the configs that hold a record survive pickling (the
spawned ranks of a GPU run receive theirs that way)."""

from __future__ import annotations

import pickle
from typing import List

import pytest
import torch

from megatron.config import ModelConfig
from megatron.kernels.fp8_linear import Fp8Recipe
from moe.config import MoEConfig
from moe.fp8_experts import dropless_fp8
from moe.kernels.grouped_gemm import (
    BACKENDS,
    MOE,
    TORCH,
    GroupedGemmBackend,
    grouped_mm_reference,
)
from moe.layers import build_moe_layer
from moe.training_hooks import MoETrainingHooks

MODEL = ModelConfig(
    num_layers=1, hidden_size=32, num_attention_heads=2, ffn_hidden_size=48,
    seq_length=16, max_position_embeddings=16, add_bias_linear=False, init_method_std=0.2,
)  # fmt: skip


def _recording_backend(
    name: str, compiles_whole: bool, fp8_products: bool, calls: List[torch.Size]
) -> GroupedGemmBackend:
    """A backend the project does not define: the reference product, noting each weight shape
    it multiplies by."""

    def multiply(x, weight, tokens_per_expert, offsets):
        calls.append(weight.shape)
        return grouped_mm_reference(x, weight, tokens_per_expert)

    return GroupedGemmBackend(name, compiles_whole, fp8_products, multiply)


def _layer(backend: GroupedGemmBackend):
    torch.manual_seed(0)
    moe = MoEConfig(num_experts=4, top_k=2, mlp_impl="grouped", grouped_gemm=backend)
    return build_moe_layer(MODEL, moe)


# A new name with every property, and torch's own name with none of them: a caller comparing
# names (or comparing with TORCH) answers one of the two wrongly.
CASES = [("third.party_grouped_mm", True), (TORCH.name, False)]
IDS = ["new-name-that-can", "torchs-name-that-cannot"]


@pytest.mark.parametrize("name, supported", CASES, ids=IDS)
def test_training_compiles_the_dmoe_whole_where_the_record_says_so(name, supported):
    moe = MoEConfig(
        num_experts=4, grouped_gemm=_recording_backend(name, supported, supported, calls=[])
    )
    hooks = MoETrainingHooks(moe, torch.bfloat16, num_layers=1, writes_metrics=False)
    assert (hooks.compile_choice(torch.device("cuda")).veto is None) == supported


@pytest.mark.skipif(
    not hasattr(torch, "_scaled_grouped_mm"),
    reason=f"torch {torch.__version__} has no torch._scaled_grouped_mm (2.9 and newer)",
)
@pytest.mark.parametrize("name, supported", CASES, ids=IDS)
def test_the_experts_turn_fp8_where_the_record_says_so(name, supported):
    layer = _layer(_recording_backend(name, supported, supported, calls=[]))
    reason = dropless_fp8(layer, Fp8Recipe("rowwise"))
    assert (reason is None) == supported, reason
    assert (layer.experts.fp8 is not None) == supported
    if not supported:
        assert f"this run's is {name}" in reason


def test_the_experts_multiply_with_the_records_product_and_the_log_names_it():
    calls: List[torch.Size] = []
    backend = _recording_backend("third.party_grouped_mm", True, False, calls)
    layer, same_on_ours = _layer(backend), _layer(MOE)
    x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(1))
    out = layer(x)
    # The experts' two products, [E, h, f] then [E, f, h], both by the record's `multiply`.
    assert calls == [torch.Size([4, 32, 48]), torch.Size([4, 48, 32])]
    torch.testing.assert_close(out, same_on_ours(x))
    assert "dMoE grouped GEMM: third.party_grouped_mm" in layer.config.notes()


@pytest.mark.parametrize("backend", BACKENDS, ids=[backend.name for backend in BACKENDS])
def test_a_config_with_a_backend_survives_pickling(backend):
    moe = MoEConfig(num_experts=4, grouped_gemm=backend)
    restored = pickle.loads(pickle.dumps(moe))
    assert restored == moe and restored.grouped_gemm.multiply is backend.multiply
