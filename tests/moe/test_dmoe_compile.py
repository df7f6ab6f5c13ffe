"""The compiled grouped dMoE: on torch._grouped_mm the layer's one data path traces as one graph
(fullgraph=True fails on a break) with the eager layer's results; on the project's own grouped
GEMM it breaks the graph, and training does not compile it."""

import pytest
import torch

from megatron.config import ModelConfig
from moe.config import MoEConfig
from moe.kernels import grouped_gemm
from moe.kernels.grouped_gemm import MOE, TORCH, GroupedGemmBackend
from moe.layers import build_moe_layer
from tests.markers import needs_torch_grouped_mm

# The one-graph compiled dMoE is built on torch._grouped_mm, which torch has from 2.8 on; older
# torch compiles the layer around its Triton ops (the last test below covers that path).


def _layer(top_k: int, mlp_type: str = "mlp", backend: GroupedGemmBackend = TORCH, **routing):
    model = ModelConfig(
        num_layers=1, hidden_size=32, num_attention_heads=2, ffn_hidden_size=48,
        seq_length=16, max_position_embeddings=16, add_bias_linear=True, init_method_std=0.2,
    )  # fmt: skip
    moe = MoEConfig(
        num_experts=4,
        top_k=top_k,
        mlp_impl="grouped",
        mlp_type=mlp_type,
        grouped_gemm=backend,
        **routing,
    )
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
        (out.float().square().sum() + layer.auxiliary_losses["load balancing loss"]).backward()
        experts = layer.experts
        gate_grad = [experts.v1.grad] if experts.v1 is not None else []
        results.append(
            [out, inputs.grad, experts.w1.grad, *gate_grad, experts.w2.grad,
             layer.router.layer.weight.grad, layer.tokens_per_expert]
        )  # fmt: skip
    assert torch.equal(results[0][-1], results[1][-1])  # the same routing
    assert results[1][-1].sum() == 32 * top_k
    for got, want in zip(results[1][:-1], results[0][:-1]):
        # The same ops, eager and traced: equal, but for the order of a few fp32 sums in
        # the traced backward.
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)


@needs_torch_grouped_mm
@pytest.mark.parametrize(
    "routing",
    [
        # The step's counts: an in-place buffer update inside the graph.
        {"load_balancing_type": "global_aux_loss", "router_score": "sigmoid"},
        {
            "load_balancing_type": "seq_aux_loss",
            "router_pre_softmax": False,
            "router_dtype": "fp32",
            "router_topk_scaling_factor": 2.0,
            "zloss_weight": 1e-3,
        },
    ],
)
def test_megatron_cores_routing_options_keep_the_layer_one_graph(routing):
    """Every routing option and balancing type traces with the layer (fullgraph=True fails on a
    break), to the eager layer's losses and counts."""
    torch._dynamo.reset()
    eager, compiled_layer = _layer(2, **routing), _layer(2, **routing)
    compiled = torch.compile(compiled_layer, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for _ in range(2):
        results = []
        for layer, run in ((eager, eager), (compiled_layer, compiled)):
            out = run(x)
            losses = layer.auxiliary_losses
            sum(losses.values()).backward(retain_graph=True)
            results.append((out, losses, layer.router.step_assignments))
        (out_eager, losses_eager, counts_eager), (out_compiled, losses_compiled, counts) = results
        torch.testing.assert_close(out_compiled, out_eager, rtol=1e-2, atol=1e-3)
        assert losses_compiled.keys() == losses_eager.keys()
        for name in losses_eager:
            torch.testing.assert_close(losses_compiled[name], losses_eager[name])
        if counts is not None:
            torch.testing.assert_close(counts, counts_eager)
    if counts is not None:
        assert counts[-1].item() == 2 * 32  # two forwards of 32 tokens, both counted


def assert_gpt_model_is_one_graph(moe: MoEConfig) -> None:
    """A two-layer GPT whose MLPs are `moe` layers traces whole under bf16 autocast: what
    training compiles (moe.training_hooks.MoETrainingHooks.compile_choice), no graph break
    anywhere."""
    from megatron.model.gpt_model import GPTModel
    from moe.mlp_spec import MoEMlpSpec

    torch._dynamo.reset()
    config = ModelConfig(
        num_layers=2, hidden_size=32, num_attention_heads=2, ffn_hidden_size=48, seq_length=16,
        max_position_embeddings=16, padded_vocab_size=64, init_method_std=0.02,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPTModel(config, MoEMlpSpec(moe))
    token_ids = torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explanation = torch._dynamo.explain(model)(token_ids, labels=token_ids)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


# Each option with state updated in every training forward keeps the graph whole: the
# per-layer loss windows (--moe-per-layer-logging) sum each layer's losses into a buffer, and
# DeepSeek-V3's bias update runs at the start of the forward (a host read of the pending counts
# there broke it in every layer: 8 graphs for a 12-layer dMoE's training step).
@needs_torch_grouped_mm
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"zloss_weight": 1e-3, "per_layer_logging": True},
        {"router_score": "sigmoid", "router_bias_update_rate": 1e-3},
    ],
    ids=["plain", "per-layer-loss-windows", "expert-bias"],
)
def test_gpt_model_with_dmoe_layers_traces_as_one_graph_under_bf16_autocast(options):
    assert_gpt_model_is_one_graph(
        MoEConfig(num_experts=4, top_k=2, mlp_impl="grouped", grouped_gemm=TORCH, **options)
    )


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
    spec = MoEMlpSpec(MoEConfig(num_experts=4, top_k=2, mlp_impl="grouped", grouped_gemm=TORCH))
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
def test_on_the_projects_grouped_gemm_the_compiled_layer_breaks_and_is_not_compiled():
    """Where torch._grouped_mm is missing or slow (torch before 2.8, AMD and pre-Hopper GPUs)
    the run's grouped GEMM is moe.kernels.grouped_gemm's op, Triton launches from Python
    (here their references): the compiled layer breaks the graph around them with the eager
    layer's results, and training does not compile the MoE model
    (moe.training_hooks.MoETrainingHooks.compile_choice)."""
    from moe.training_hooks import MoETrainingHooks

    torch._dynamo.reset()
    eager, compiled_layer = _layer(2, backend=MOE), _layer(2, backend=MOE)
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
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)

    for backend, veto in ((MOE, True), (TORCH, False)):
        moe = MoEConfig(num_experts=4, top_k=2, mlp_impl="grouped", grouped_gemm=backend)
        hooks = MoETrainingHooks(moe, torch.bfloat16, num_layers=2, writes_metrics=False)
        said = hooks.compile_choice(torch.device("cuda")).veto
        assert (said is not None and "without torch.compile" in said) == veto


def test_the_grouped_gemm_is_torchs_only_where_it_is_fast(monkeypatch):
    """choose_backend: torch._grouped_mm only in bf16, on a device where it is fast, with
    operand widths its TMA loads accept, fewer than 1024 experts and the kernel mode "auto";
    else the project's op."""
    device = torch.device("cpu")  # not a fast device
    assert grouped_gemm.choose_backend(device, torch.bfloat16, (768, 3072), 64, "auto") == MOE
    monkeypatch.setattr(grouped_gemm, "torch_grouped_mm_is_fast_on", lambda device: True)
    assert grouped_gemm.choose_backend(device, torch.bfloat16, (768, 3072), 64, "auto") == TORCH
    for dtype, widths, groups, mode in (
        (torch.float16, (768, 3072), 64, "auto"),
        (torch.float32, (768, 3072), 64, "auto"),
        (torch.bfloat16, (768, 3071), 64, "auto"),
        (torch.bfloat16, (768, 3072), 1024, "auto"),
        (torch.bfloat16, (768, 3072), 64, "triton"),
        (torch.bfloat16, (768, 3072), 64, "reference"),
    ):
        assert grouped_gemm.choose_backend(device, dtype, widths, groups, mode) == MOE
