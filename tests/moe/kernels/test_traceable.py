"""The torch.compile path of the grouped dMoE (moe.kernels.traceable): same function as the
Triton ops and the loop reference, and traced as one graph (fullgraph=True fails on a break)."""

import pytest
import torch

from megatron.config import ModelConfig
from moe.config import MoEConfig
from moe.kernels import grouped_gemm, permute, traceable
from moe.layers import build_moe_layer

# The one-graph compiled dMoE is built on torch._grouped_mm, which torch has from 2.8 on; older
# torch compiles the layer around its Triton ops (the last test below covers that path).
needs_torch_grouped_mm = pytest.mark.skipif(
    not grouped_gemm.torch_has_grouped_mm(),
    reason=f"torch {torch.__version__} has no torch._grouped_mm (2.8 and newer)",
)


def _routing(tokens: int, top_k: int, num_experts: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, num_experts, generator=generator)
    expert_indices = scores.topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, generator=generator, dtype=torch.float64)
    return expert_indices, weights


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_sort_assignments_matches_the_stable_sort_and_histogram(top_k):
    expert_indices, _ = _routing(37, top_k, 6)
    order, slot_of, tokens_per_expert = traceable.sort_assignments(expert_indices, 6)
    flat = expert_indices.reshape(-1).int()
    _, want_order = permute.sort_by_expert_reference(flat, 6)
    assert torch.equal(order.int(), want_order)
    assert torch.equal(slot_of[order], torch.arange(flat.numel()))
    assert torch.equal(tokens_per_expert, permute.expert_histogram_reference(flat, 6))
    assert tokens_per_expert.dtype == torch.int32


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_gather_and_sum_match_the_permute_references_with_gradients(top_k):
    tokens, hidden, num_experts = 29, 8, 5
    expert_indices, _ = _routing(tokens, top_k, num_experts, seed=top_k)
    order, slot_of, tokens_per_expert = traceable.sort_assignments(expert_indices, num_experts)
    bins = torch.cumsum(tokens_per_expert, 0).int()
    x = torch.randn(tokens, hidden, dtype=torch.float64, requires_grad=True)
    y = torch.randn(tokens * top_k, hidden, dtype=torch.float64, requires_grad=True)
    results = {}
    for name, gather, sum_rows in (
        ("traceable", lambda x: traceable.gather_rows(x, order, slot_of, top_k),
         lambda y: traceable.sum_rows(y, order, slot_of, top_k)),
        ("reference", lambda x: permute.gather_reference(x, order.int(), bins, top_k),
         lambda y: permute.scatter_reference(y, order.int(), None, bins, top_k)),
    ):  # fmt: skip
        for tensor in (x, y):
            tensor.grad = None
        gathered = gather(x)
        summed = sum_rows(y)
        (gathered.sin().sum() + summed.cos().sum()).backward()
        results[name] = (gathered, summed, x.grad, y.grad)
    for got, want in zip(results["traceable"], results["reference"]):
        # both accumulate the top_k rows in fp32, in different orders
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _layer(top_k: int, shared_expert: bool = False, mlp_type: str = "mlp"):
    model = ModelConfig(
        num_layers=1, hidden_size=32, num_attention_heads=2, ffn_hidden_size=48,
        seq_length=16, max_position_embeddings=16, add_bias_linear=True, init_method_std=0.2,
    )  # fmt: skip
    moe = MoEConfig(
        num_experts=4, top_k=top_k, mlp_impl="grouped", shared_expert=shared_expert,
        mlp_type=mlp_type,
    )  # fmt: skip
    torch.manual_seed(0)
    return build_moe_layer(model, moe).to(torch.bfloat16)


@needs_torch_grouped_mm
@pytest.mark.parametrize("top_k,mlp_type", [(1, "mlp"), (2, "mlp"), (2, "glu")])
def test_compiled_grouped_dmoe_is_one_graph_and_matches_eager(top_k, mlp_type):
    torch._dynamo.reset()
    eager, compiled_layer = _layer(top_k, mlp_type=mlp_type), _layer(top_k, mlp_type=mlp_type)
    compiled = torch.compile(compiled_layer, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    results = []
    for layer, run in ((eager, eager), (compiled_layer, compiled)):
        inputs = x.clone().requires_grad_()
        out = run(inputs)
        (out.float().square().sum() + layer.load_balancing_loss).backward()
        experts = layer.experts
        gate_grad = [experts.v1.grad] if experts.v1 is not None else []
        results.append(
            [out, inputs.grad, experts.w1.grad, *gate_grad, experts.w2.grad,
             layer.router.layer.weight.grad, layer.tokens_per_expert]
        )  # fmt: skip
    assert torch.equal(results[0][-1], results[1][-1])  # the same routing
    assert results[1][-1].sum() == 32 * top_k
    for got, want in zip(results[1][:-1], results[0][:-1]):
        # bf16 results of the same math, rounded at other places (the compiled layer scales
        # the activations by the router's weights, the eager one the outputs; sums in another
        # order): about 4e-3 apart in norm. Elementwise, entries near zero differ by more.
        got, want = got.double(), want.double()
        assert (got - want).norm() / want.norm() < 1e-2


@needs_torch_grouped_mm
def test_gpt_model_with_dmoe_layers_traces_as_one_graph_under_bf16_autocast():
    """What training compiles (moe.training_hooks.MoETrainingHooks.compile_veto): no graph
    break anywhere."""
    from megatron.model.gpt_model import GPTModel
    from moe.mlp_spec import MoEMlpSpec

    torch._dynamo.reset()
    config = ModelConfig(
        num_layers=2, hidden_size=32, num_attention_heads=2, ffn_hidden_size=48, seq_length=16,
        max_position_embeddings=16, padded_vocab_size=64, init_method_std=0.02,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPTModel(config, MoEMlpSpec(MoEConfig(num_experts=4, top_k=2, mlp_impl="grouped")))
    token_ids = torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explanation = torch._dynamo.explain(model)(token_ids, labels=token_ids)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@needs_torch_grouped_mm
@pytest.mark.parametrize("accumulate_in_place", [True, False])
def test_compiled_gpt_uses_the_refreshed_expert_weight_copies(accumulate_in_place):
    """Training in bf16 keeps bf16 copies of the fp32 expert weights (refreshed each step, see
    moe.experts.refresh_compute_weights). The compiled model must read the copies as they are
    at each call (refreshed in place, never baked into the graph) and give the results of the
    per-call cast, gradients for the fp32 weights included: through the copies' hooks (in
    place) or through autograd. Two backwards per step check that gradients accumulate."""
    from megatron.model.gpt_model import GPTModel
    from moe.experts import flush_expert_gradients, refresh_compute_weights
    from moe.mlp_spec import MoEMlpSpec

    torch._dynamo.reset()
    config = ModelConfig(
        num_layers=2, hidden_size=32, num_attention_heads=2, ffn_hidden_size=48, seq_length=16,
        max_position_embeddings=16, padded_vocab_size=64, init_method_std=0.02,
        hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    spec = MoEMlpSpec(MoEConfig(num_experts=4, top_k=2, mlp_impl="grouped"))
    token_ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))

    def loss_and_grads(model, run):
        model.zero_grad()
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = run(token_ids, labels=token_ids).float().mean()
            loss.backward()
        flush_expert_gradients(model)  # the trainer's step does this after the last backward
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    torch.manual_seed(0)
    cast, copied = GPTModel(config, spec), GPTModel(config, spec)
    copied.load_state_dict(cast.state_dict())
    assert refresh_compute_weights(copied, torch.bfloat16, accumulate_in_place) == 2
    run_cast = torch.compile(cast, backend="aot_eager", fullgraph=True)
    run_copied = torch.compile(copied, backend="aot_eager", fullgraph=True)
    for step in range(2):
        want, got = loss_and_grads(cast, run_cast), loss_and_grads(copied, run_copied)
        for a, b in zip(got, want):
            assert torch.equal(a, b), step
        with torch.no_grad():  # an optimizer step, then the trainer's refresh
            for model in (cast, copied):
                for param in model.parameters():
                    param.mul_(1.5)
        refresh_compute_weights(copied, torch.bfloat16, accumulate_in_place)


# Dynamo warns about each op it cannot trace on the eager path: the graph breaks asserted below.
@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace")
def test_without_torch_grouped_mm_the_compiled_layer_runs_the_triton_path(monkeypatch):
    """torch before 2.8 has no torch._grouped_mm (and AMD or pre-Hopper GPUs have no fast one):
    the compiled layer must not call it but take the eager path (Triton kernels, here their
    references), graph breaks and all, with the eager layer's results; training then does not
    compile the MoE model (moe.training_hooks.MoETrainingHooks.compile_veto). Simulated by
    patching the one check (deleting torch._grouped_mm would also break torch's own tracing)."""
    from megatron.config import TrainingConfig
    from moe.kernels import grouped_gemm
    from moe.training_hooks import MoETrainingHooks

    assert traceable.runs_on(torch.device("cpu")) == hasattr(torch, "_grouped_mm")
    monkeypatch.setattr(grouped_gemm, "torch_has_grouped_mm", lambda: False)
    assert not traceable.runs_on(torch.device("cpu"))
    torch._dynamo.reset()
    eager, compiled_layer = _layer(2), _layer(2)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    explanation = torch._dynamo.explain(compiled_layer)(x)
    assert explanation.graph_break_count > 0
    torch._dynamo.reset()
    compiled = torch.compile(compiled_layer, backend="aot_eager")
    results = []
    for layer, run in ((eager, eager), (compiled_layer, compiled)):
        inputs = x.clone().requires_grad_()
        out = run(inputs)
        out.float().square().sum().backward()
        results.append([out, inputs.grad, layer.experts.w1.grad, layer.experts.w2.grad])
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    hooks = MoETrainingHooks(
        MoEConfig(num_experts=4, top_k=2, mlp_impl="grouped"),
        TrainingConfig(micro_batch_size=1, global_batch_size=1, num_micro_batches=1, bf16=True),
        num_layers=2,
        tensorboard=False,
    )
    assert "without torch.compile" in hooks.compile_veto(torch.device("cpu"))
