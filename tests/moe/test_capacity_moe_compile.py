"""The compiled MoE with capacity (--no-moe-dropless): its layer traces as one graph on one rank
and under expert parallelism (fullgraph=True fails on a break) with the eager layer's numbers,
a GPT model of such layers has no graph break, and training compiles it unless the capacity is
unlimited (moe.training_hooks.MoETrainingHooks.compile_choice)."""

import pytest
import torch

from megatron.config import ModelConfig
from megatron.parallel import parallel_state
from megatron.parallelize.steps import CompileChoice, compile_model
from moe.config import MoEConfig
from moe.layers import build_moe_layer
from tests.launch import run_distributed
from tests.moe.test_dmoe_compile import assert_gpt_model_is_one_graph
from tests.moe.test_expert_parallel import make_layer, make_tokens, probe


def _layer(top_k: int, capacity_factor: float):
    model = ModelConfig(
        num_layers=1, hidden_size=32, num_attention_heads=2, ffn_hidden_size=48,
        seq_length=16, max_position_embeddings=16, add_bias_linear=True, init_method_std=0.2,
    )  # fmt: skip
    moe = MoEConfig(
        num_experts=4, top_k=top_k, mlp_impl="grouped", dropless=False,
        capacity_factor=capacity_factor,
    )  # fmt: skip
    torch.manual_seed(0)
    return build_moe_layer(model, moe).to(torch.bfloat16)


def _step(layer, run, x):
    inputs = x.clone().requires_grad_()
    out = run(inputs)
    (out.float().square().sum() + layer.auxiliary_losses["load balancing loss"]).backward()
    experts = layer.experts
    return [out, inputs.grad, experts.w1.grad, experts.w2.grad, layer.router.layer.weight.grad]


@pytest.mark.parametrize("top_k,capacity_factor", [(1, 1.0), (2, 0.5)])
def test_compiled_capacity_moe_is_one_graph_and_matches_eager(top_k, capacity_factor):
    torch._dynamo.reset()
    eager, compiled_layer = _layer(top_k, capacity_factor), _layer(top_k, capacity_factor)
    compiled = torch.compile(compiled_layer, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    want, got = _step(eager, eager, x), _step(compiled_layer, compiled, x)
    assert torch.equal(eager.tokens_per_expert, compiled_layer.tokens_per_expert)
    assert compiled_layer.tokens_per_expert.max() > 32 * top_k * capacity_factor / 4  # drops
    for got_tensor, want_tensor in zip(got, want):
        # The same ops, eager and traced: equal but for the order of a few fp32 sums.
        torch.testing.assert_close(got_tensor, want_tensor, rtol=1e-2, atol=1e-3)


def test_gpt_model_with_capacity_moe_layers_traces_as_one_graph_under_bf16_autocast():
    assert_gpt_model_is_one_graph(
        MoEConfig(num_experts=4, top_k=2, mlp_impl="grouped", dropless=False)
    )


def test_training_compiles_the_capacity_moe_unless_its_capacity_is_unlimited():
    from moe.training_hooks import MoETrainingHooks

    for capacity_factor, impl, compiles in ((1.0, "grouped", True), (0.0, "grouped", False),
                                            (1.0, "reference", False)):  # fmt: skip
        moe = MoEConfig(
            num_experts=4, top_k=1, mlp_impl=impl, dropless=False,
            capacity_factor=capacity_factor,
        )  # fmt: skip
        hooks = MoETrainingHooks(moe, torch.bfloat16, num_layers=2, writes_metrics=False)
        assert (hooks.compile_choice(torch.device("cuda")).veto is None) == compiles, moe


def _compiled_expert_parallel_step(rank: int, world_size: int) -> list:
    """The capacity MoE's layer at EP `world_size`, eagerly and compiled as one graph: the
    differences of its output and gradients."""
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world_size)
    try:
        runs = []
        for compiled in (False, True):
            torch._dynamo.reset()
            layer = make_layer("grouped", 2, world_size, None, dropless=False)
            run = compile_model(layer, CompileChoice(), backend="aot_eager", fullgraph=True)
            tokens = make_tokens(world_size, None)[rank : rank + 1].clone().requires_grad_(True)
            output = (run if compiled else layer)(tokens)
            (output * probe(world_size)[rank : rank + 1]).sum().backward()
            runs.append([output.detach(), tokens.grad] + [p.grad for p in layer.parameters()])
        return [(a - b).abs().max().item() for a, b in zip(*runs)]
    finally:
        parallel_state.destroy_model_parallel()


def test_compiled_capacity_moe_under_expert_parallelism_matches_eager():
    """The slots' all-to-alls trace with the rest (equal splits: no counts, no host sync)."""
    for errors in run_distributed(_compiled_expert_parallel_step, 2):
        assert max(errors) < 1e-5, errors
