"""MoE and dMoE layers against the dense MLP and the loop-over-experts reference."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from megatron.config import ConfigError, ModelConfig
from megatron.model import GPTModel
from megatron.model.mlp import MLP
from moe.auxiliary_losses import MoEAuxiliaryLosses
from moe.config import MoEConfig
from moe.layers import DroplessMoE, MoE, build_moe_layer
from moe.mlp_spec import MoEMlpSpec

REPO = Path(__file__).resolve().parents[2]
HIDDEN, FFN = 16, 32


pytestmark = pytest.mark.usefixtures("reference_kernels")


def model_config(**overrides) -> ModelConfig:
    base = dict(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        ffn_hidden_size=FFN,
        seq_length=8,
        max_position_embeddings=8,
        add_bias_linear=False,
    )
    return ModelConfig(**{**base, **overrides})


def make_layer(seed=0, model=None, **moe):
    torch.manual_seed(seed)
    config = MoEConfig(**{"num_experts": 4, "zloss_weight": 1e-3, **moe})
    return build_moe_layer(model or model_config(), config)


def run(layer, x, extra_loss=True):
    """Output and gradients of (input, router, every expert weight) for a fixed loss."""
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad()
    output = layer(x)
    loss = (output * torch.linspace(-1, 1, output.numel()).view_as(output)).sum()
    if extra_loss:
        loss = loss + sum(layer.auxiliary_losses.values())
    loss.backward()
    grads = {"input": x.grad}
    grads.update({name: p.grad for name, p in layer.named_parameters()})
    return output.detach(), grads


def assert_same(first, second, atol=1e-5):
    out_a, grads_a = first
    out_b, grads_b = second
    torch.testing.assert_close(out_a, out_b, atol=atol, rtol=1e-4)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=atol, rtol=1e-4, msg=name)


def same_weights(reference, other):
    other.load_state_dict(reference.state_dict())
    return other


@pytest.mark.parametrize("swiglu", [False, True])
def test_one_expert_top1_dmoe_is_the_dense_mlp(swiglu):
    config = model_config(swiglu=swiglu)
    layer = make_layer(model=config, num_experts=1, mlp_type="glu" if swiglu else "mlp")
    dense = MLP(config)
    with torch.no_grad():
        fc1 = dense.linear_fc1.weight  # [F or 2F, h]
        if swiglu:
            gate, up = fc1.chunk(2, dim=0)
            layer.experts.w1[0].copy_(gate.t())
            layer.experts.v1[0].copy_(up.t())
        else:
            layer.experts.w1[0].copy_(fc1.t())
        layer.experts.w2[0].copy_(dense.linear_fc2.weight.t())
    x = torch.randn(2, 8, HIDDEN)
    torch.testing.assert_close(layer(x), dense(x), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("mlp_type", ["mlp", "glu"])
def test_grouped_dmoe_matches_reference_loop(top_k, mlp_type):
    reference = make_layer(num_experts=6, top_k=top_k, mlp_impl="reference", mlp_type=mlp_type)
    grouped = same_weights(
        reference, make_layer(num_experts=6, top_k=top_k, mlp_impl="grouped", mlp_type=mlp_type)
    )
    assert isinstance(grouped, DroplessMoE)
    x = torch.randn(3, 8, HIDDEN)
    assert_same(run(reference, x), run(grouped, x))


def test_dmoe_output_is_the_weighted_sum_of_chosen_experts():
    layer = make_layer(top_k=2, mlp_impl="grouped")
    x = torch.randn(5, HIDDEN)
    routing = layer.router(x)
    expected = torch.zeros_like(x)
    for t in range(5):
        for j in range(2):
            expert = int(routing.expert_indices[t, j])
            expected[t] += (
                routing.expert_weights[t, j] * layer.experts.forward_expert(expert, x[t : t + 1])[0]
            )
    torch.testing.assert_close(layer(x.view(1, 5, HIDDEN)).view(5, HIDDEN), expected)


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_with_ample_capacity_equals_dmoe(top_k):
    dmoe = make_layer(top_k=top_k, mlp_impl="grouped")
    moe = same_weights(
        dmoe,
        make_layer(top_k=top_k, mlp_impl="grouped", dropless=False, capacity_factor=4.0 / top_k),
    )
    assert isinstance(moe, MoE)
    x = torch.randn(2, 8, HIDDEN)
    assert_same(run(dmoe, x), run(moe, x))


def kept_assignments(expert_indices: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Bool [T, k]: which assignments an expert accepts, each keeping its first `capacity` in
    assignment order (t * k + j), as moe.reference does."""
    flat = expert_indices.reshape(-1)
    kept = torch.zeros_like(flat, dtype=torch.bool)
    for expert in range(num_experts):
        kept[torch.nonzero(flat == expert).squeeze(1)[:capacity]] = True
    return kept.view_as(expert_indices)


@pytest.mark.parametrize("top_k", [1, 2])
def test_small_capacity_drops_exactly_the_reference_assignments(top_k):
    kwargs = dict(top_k=top_k, dropless=False, capacity_factor=0.5)
    reference = make_layer(mlp_impl="reference", **kwargs)
    grouped = same_weights(reference, make_layer(mlp_impl="grouped", **kwargs))
    x = torch.randn(2, 8, HIDDEN)
    assert_same(run(reference, x), run(grouped, x))

    tokens = x.view(-1, HIDDEN)
    capacity = grouped.expert_capacity(tokens.shape[0])
    assert capacity == int(0.5 * top_k * 16 / 4)
    routing = grouped.router(tokens)
    kept = kept_assignments(routing.expert_indices, 4, capacity)
    assert not kept.all(), "the test should drop some assignments"
    # Each expert keeps its first `capacity` assignments in token order (t * k + j).
    flat = routing.expert_indices.reshape(-1)
    for expert in range(4):
        positions = torch.nonzero(flat == expert).squeeze(1)
        assert kept.reshape(-1)[positions].tolist() == [i < capacity for i in range(len(positions))]
    # Outputs equal the sum over kept assignments only; all-dropped tokens output zero.
    expected = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for j in range(top_k):
            if kept[t, j]:
                expert = int(routing.expert_indices[t, j])
                expected[t] += (
                    routing.expert_weights[t, j]
                    * grouped.experts.forward_expert(expert, tokens[t : t + 1])[0]
                )
    with torch.no_grad():
        torch.testing.assert_close(grouped(x).view(-1, HIDDEN), expected)


@pytest.mark.parametrize("top_k", [1, 2])
def test_megatron_cores_capacity_rounds_up_and_drops_the_lowest_weights(top_k):
    """Megatron-Core's capacity (--moe-expert-capacity-factor): ceil(F k T / E), each expert
    keeping its highest-weight assignments (its `probs` policy), the reference's and the
    grouped layer's alike."""
    kwargs = dict(top_k=top_k, dropless=False, capacity_factor=0.45)
    kwargs.update(capacity_rounds_up=True, drop_by_weight=True)
    reference = make_layer(mlp_impl="reference", **kwargs)
    grouped = same_weights(reference, make_layer(mlp_impl="grouped", **kwargs))
    x = torch.randn(2, 8, HIDDEN)
    assert_same(run(reference, x), run(grouped, x))

    tokens = x.view(-1, HIDDEN)
    capacity = grouped.expert_capacity(tokens.shape[0])
    assert capacity == math.ceil(0.45 * top_k * 16 / 4) == int(0.45 * top_k * 16 / 4) + 1
    routing = grouped.router(tokens)
    flat, weights = routing.expert_indices.reshape(-1), routing.expert_weights.reshape(-1)
    kept = torch.zeros_like(flat, dtype=torch.bool)
    for expert in range(4):
        mine = torch.nonzero(flat == expert).squeeze(1)
        kept[mine[weights[mine].argsort(descending=True)[:capacity]]] = True
    assert not kept.all(), "the test should drop some assignments"
    expected = torch.zeros_like(tokens)
    for assignment in torch.nonzero(kept).squeeze(1).tolist():
        t, expert = assignment // top_k, int(flat[assignment])
        output = grouped.experts.forward_expert(expert, tokens[t : t + 1])[0]
        expected[t] += weights[assignment] * output
    with torch.no_grad():
        torch.testing.assert_close(grouped(x).view(-1, HIDDEN), expected)


def test_capacity_zero_means_no_drops():
    dmoe = make_layer(top_k=2, mlp_impl="grouped")
    moe = same_weights(dmoe, make_layer(top_k=2, dropless=False, capacity_factor=0.0))
    x = torch.randn(2, 8, HIDDEN)
    assert_same(run(dmoe, x), run(moe, x))


@pytest.mark.parametrize("mlp_type", ["mlp", "glu"])
@pytest.mark.parametrize("dropless", [True, False])
def test_memory_optimized_mlp_matches_plain(mlp_type, dropless):
    kwargs = dict(top_k=2, mlp_type=mlp_type, dropless=dropless)
    plain = make_layer(**kwargs)
    optimized = same_weights(plain, make_layer(memory_optimized_mlp=True, **kwargs))
    x = torch.randn(2, 8, HIDDEN)
    assert_same(run(plain, x), run(optimized, x))


def test_shared_expert_and_output_bias_are_added():
    config = model_config(add_bias_linear=True)
    layer = make_layer(model=config, top_k=2, shared_expert=True, shared_expert_ffn_hidden_size=8)
    assert layer.shared_expert.linear_fc1.out_features == 8
    x = torch.randn(1, 4, HIDDEN)
    with torch.no_grad():
        layer.bias.fill_(0.5)
        expected = (
            layer.compute_experts(x.view(-1, HIDDEN), layer.router(x.view(-1, HIDDEN)))[0]
            + 0.5
            + layer.shared_expert(x.view(-1, HIDDEN))
        )
        torch.testing.assert_close(layer(x).view(-1, HIDDEN), expected)


def test_tokens_per_expert_stats_and_auxiliary_losses():
    layer = make_layer(top_k=2, loss_weight=0.1, zloss_weight=0.01)
    x = torch.randn(2, 8, HIDDEN)
    layer(x)
    assert layer.tokens_per_expert.sum().item() == 2 * 16
    losses = MoEAuxiliaryLosses(layer)()
    assert set(losses) == {"load balancing loss", "router z loss"}
    assert losses["load balancing loss"].item() >= 0.1 * 0.99  # >= weight at balance
    with pytest.raises(RuntimeError, match="before every MoE layer ran"):
        MoEAuxiliaryLosses(layer)()


def test_expert_bias_update_moves_load_toward_balance():
    layer = make_layer(top_k=1, router_bias_update_rate=0.05, loss_weight=0.0)
    with torch.no_grad():
        layer.router.layer.weight[0] += 1.0  # expert 0 attracts tokens whose sum is positive
    x = torch.randn(4, 16, HIDDEN).abs()
    layer.train()
    expert_0_rows = []
    for _ in range(60):
        layer(x)
        expert_0_rows.append(layer.tokens_per_expert[0].item())
    assert expert_0_rows[0] == 64  # all of them
    # These tokens' scores are nearly alike, so their load swings from expert to expert as the
    # biases pass each other (by equal steps, every bias may drift): the attracting expert's
    # bias ends lowest, and its load falls on average.
    bias = layer.router.expert_bias
    assert bias[0] < bias[1:].min()
    assert sum(expert_0_rows[-30:]) / 30 < 48
    layer.eval()  # no updates outside training
    bias = layer.router.expert_bias.clone()
    layer(x)
    layer(x)
    assert torch.equal(bias, layer.router.expert_bias)


def test_recomputed_forward_does_not_count_twice():
    from torch.utils.checkpoint import checkpoint

    layer = make_layer(top_k=2, router_bias_update_rate=0.01)
    layer.train()
    x = torch.randn(2, 8, HIDDEN, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert layer.pending_tokens_per_expert.sum().item() == 2 * 16


def test_mlp_spec_puts_moe_in_every_layer_freq_th_layer():
    moe = MoEConfig(num_experts=4, layer_freq=2)
    config = model_config(num_layers=4)
    kinds = [type(MoEMlpSpec(moe).build(config, index)) for index in range(4)]
    assert kinds == [DroplessMoE, MLP, DroplessMoE, MLP]
    assert isinstance(MoEMlpSpec(dataclasses.replace(moe, dropless=False)).build(config, 0), MoE)


def test_mlp_spec_puts_moe_where_the_layer_pattern_marks():
    """--moe-layer-freq's pattern form: one mark per layer (megatron.config.layer_pattern)."""
    moe = MoEConfig(num_experts=4, layer_freq=(False, True, True, False))
    config = model_config(num_layers=4)
    kinds = [type(MoEMlpSpec(moe).build(config, index)) for index in range(4)]
    assert kinds == [MLP, DroplessMoE, DroplessMoE, MLP]
    assert moe.num_moe_layers(4) == 2


def test_gpt_model_with_moe_inits_experts_and_trains_one_step():
    moe = MoEConfig(num_experts=4, top_k=2)
    config = model_config(padded_vocab_size=64, init_method_std=0.02)
    torch.manual_seed(0)
    model = GPTModel(config, MoEMlpSpec(moe))
    w2 = model.decoder.layers[0].mlp.experts.w2
    assert abs(w2.std().item() - 0.02 / 2.0) < 0.003  # scaled init: std / sqrt(2 L)
    tokens = torch.randint(0, 64, (2, 8))
    losses = model(tokens, labels=tokens)
    assert losses.shape == (2, 8)
    auxiliary = MoEAuxiliaryLosses(model)()
    (losses.mean() + auxiliary["load balancing loss"]).backward()
    assert model.decoder.layers[1].mlp.router.layer.weight.grad.abs().sum() > 0


def test_sparse_backend_matches_reference():
    sparse = make_layer(top_k=2, mlp_impl="sparse")
    reference = same_weights(sparse, make_layer(top_k=2, mlp_impl="reference"))
    x = torch.randn(2, 8, HIDDEN)
    assert_same(run(reference, x), run(sparse, x))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(top_k=5), "--moe-top-k 5"),
        (dict(num_experts=0), "--moe-num-experts"),
        (dict(capacity_factor=-1.0), "--moe-capacity-factor"),
        (dict(layer_freq=3), "--moe-layer-freq 3"),
        (dict(jitter_eps=1.5), "--moe-jitter-eps"),
        (dict(normalize_expert_weights=0.0), "--moe-normalize-expert-weights"),
        (dict(mlp_impl="sparse", dropless=False), "--moe-impl sparse"),
        (dict(mlp_impl="sparse", mlp_type="glu"), "--moe-impl sparse supports --mlp-type mlp"),
        (dict(shared_expert_ffn_hidden_size=8), "--moe-shared-expert"),
    ],
)
def test_config_errors_name_the_flag(overrides, message):
    config = MoEConfig(**{"num_experts": 4, **overrides})
    with pytest.raises(ConfigError, match=message.replace("-", r"\-")):
        config.validate(model_config())


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(shared_expert=True, shared_expert_ffn_hidden_size=9), "--moe-shared-expert-ffn-hidden-size 9"),
        (dict(shared_expert=True), f"--moe-shared-expert-ffn-hidden-size {FFN + 1}"),
        (dict(mlp_impl="sparse"), "--tensor-model-parallel-size 2 needs --ffn-hidden-size divisible by 32"),
    ],
)  # fmt: skip
def test_tensor_parallel_splits_are_checked_before_building(overrides, message):
    # FFN + 1 channels do not split over 2 tensor-parallel ranks (the experts' own channels
    # are checked with the dense MLP's, megatron.config.validation).
    config = MoEConfig(**{"num_experts": 4, **overrides})
    with pytest.raises(ConfigError, match=message.replace("-", r"\-")):
        config.validate(model_config(tensor_model_parallel_size=2, ffn_hidden_size=FFN + 1))
    if config.mlp_impl != "sparse":
        config.validate(model_config(tensor_model_parallel_size=1, ffn_hidden_size=FFN + 1))


def test_the_block_sparse_backend_needs_whole_blocks_at_any_tensor_parallel_size():
    config = MoEConfig(num_experts=4, mlp_impl="sparse")
    with pytest.raises(ConfigError, match="needs --ffn-hidden-size divisible by 16"):
        config.validate(model_config(ffn_hidden_size=FFN + 1))


def test_grouped_dmoe_with_triton_kernels_under_the_interpreter(triton_kernels, monkeypatch):
    """The grouped backend on the real Triton kernels (token rows, scaled activation, grouped
    GEMM) == the loop reference."""
    from moe.kernels import grouped_gemm, scaled_activation, token_rows

    def refuse(*args, **kwargs):
        raise AssertionError("a reference ran instead of the Triton kernel")

    for module, name in (
        (grouped_gemm, "grouped_mm_reference"), (grouped_gemm, "_weight_grad_reference"),
        (token_rows, "gather_rows_reference"), (token_rows, "sum_rows_reference"),
        (scaled_activation, "scaled_activation_reference"),
        (scaled_activation, "scaled_activation_backward_reference"),
    ):  # fmt: skip
        monkeypatch.setattr(module, name, refuse)

    model = ModelConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
        seq_length=8, max_position_embeddings=8, add_bias_linear=False,
    )  # fmt: skip
    results = []
    for impl in ("reference", "grouped"):
        torch.manual_seed(0)
        layer = build_moe_layer(model, MoEConfig(num_experts=4, top_k=2, mlp_impl=impl))
        x = torch.randn(1, 8, 16, requires_grad=True)
        output = layer(x)
        output.square().sum().backward()
        results.append(
            [output.detach(), x.grad, layer.experts.w1.grad, layer.router.layer.weight.grad]
        )
    for reference, kernel in zip(*results):
        torch.testing.assert_close(kernel, reference, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("impl", ["grouped", "sparse"])
def test_dmoe_under_bf16_autocast_with_fp32_weights(impl):
    """As in training: fp32 parameters, bf16 autocast. Close to the fp32 layer, weights get fp32 grads."""
    model = ModelConfig(
        num_layers=2, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64,
        seq_length=16, max_position_embeddings=16, add_bias_linear=False,
    )  # fmt: skip
    torch.manual_seed(0)
    # top_k == experts: every token reaches every expert, so bf16 router logits cannot flip a
    # close top-k choice and the comparison measures precision only.
    layer = build_moe_layer(model, MoEConfig(num_experts=4, top_k=4, mlp_impl=impl))
    x = torch.randn(2, 16, 32)
    exact = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = layer(x)
    mixed.float().square().sum().backward()
    assert mixed.dtype == torch.bfloat16
    assert ((mixed.float() - exact).norm() / exact.norm()).item() < 2e-2
    assert layer.experts.w1.grad.dtype == torch.float32


def test_mlp_spec_counts_the_router_and_top_k_experts_in_the_flops():
    from megatron.model import num_floating_point_operations

    config = model_config(num_layers=4, padded_vocab_size=64)
    dense = num_floating_point_operations(config, batch_size=2, seq_length=8)
    top1 = MoEMlpSpec(MoEConfig(num_experts=4, top_k=1, layer_freq=2))
    router = 3 * 2 * 8 * 2 * config.hidden_size * 4  # forward + backward, per MoE layer
    assert num_floating_point_operations(config, 2, 8, top1) == dense + 2 * router
    top2 = MoEMlpSpec(MoEConfig(num_experts=4, top_k=2, layer_freq=1))
    expert = 3 * 2 * 8 * 2 * 2 * config.hidden_size * config.ffn_hidden_size
    assert num_floating_point_operations(config, 2, 8, top2) == dense + 4 * (router + expert)
