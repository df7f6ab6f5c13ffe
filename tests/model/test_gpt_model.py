"""GPTModel against an independent reference forward, plus shapes, causality, ties and init."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.config import ModelConfig
from megatron.model import GPTModel, param_groups_for_weight_decay
from tests.tiny_gpt import tiny_model_config


def tiny_config(**overrides) -> ModelConfig:
    """`tiny_model_config` (2 layers, dropout off) with 12-token samples, 16 positions and a
    40-token vocabulary."""
    fields = dict(seq_length=12, max_position_embeddings=16, padded_vocab_size=40)
    return tiny_model_config(**{**fields, **overrides})


def build(config: ModelConfig, seed: int = 0) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(config)


def random_tokens(config: ModelConfig, batch: int = 3, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(
        0, config.padded_vocab_size, (batch, config.seq_length), generator=generator
    )


# ---------------------------------------------------------------------------------------------
# Reference forward: explicit matmuls, per-head loops and complex-number RoPE, reading the
# parameters by their checkpoint names. Shares no code with megatron.model.


def ref_norm(config, params, prefix, x):
    weight = params[prefix + ".weight"]
    if config.normalization == "RMSNorm":
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + config.layernorm_epsilon) * weight
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + config.layernorm_epsilon) * weight + params[
        prefix + ".bias"
    ]


def ref_linear(params, prefix, x):
    y = x @ params[prefix + ".weight"].t()
    bias = params.get(prefix + ".bias")
    return y if bias is None else y + bias


def ref_rope(config, x):
    """x [b, s, heads, d]: channel i pairs with i + rd/2 as the real/imaginary part."""
    rotary_dim = int(config.kv_channels * config.rotary_percent)
    half = rotary_dim // 2
    positions = torch.arange(x.shape[1], dtype=torch.float64)
    theta = config.rotary_base ** (-torch.arange(half, dtype=torch.float64) * 2 / rotary_dim)
    rotation = torch.polar(
        torch.ones(x.shape[1], half, dtype=torch.float64), positions[:, None] * theta
    )
    pairs = torch.complex(x[..., :half].double(), x[..., half:rotary_dim].double())
    rotated = pairs * rotation[None, :, None, :]
    return torch.cat([rotated.real.float(), rotated.imag.float(), x[..., rotary_dim:]], dim=-1)


def reference_forward(model: GPTModel, config: ModelConfig, tokens: torch.Tensor):
    params = dict(model.named_parameters())
    batch, seq = tokens.shape
    heads = config.num_attention_heads
    groups = config.num_query_groups or heads
    per_group = heads // groups
    d = config.kv_channels

    x = params["embedding.word_embeddings.weight"][tokens]
    if config.position_embedding_type == "learned_absolute":
        x = x + params["embedding.position_embeddings.weight"][:seq]
    causal = torch.tril(torch.ones(seq, seq, dtype=torch.bool))
    for i in range(config.num_layers):
        p = f"decoder.layers.{i}."
        y = ref_norm(config, params, p + "input_layernorm", x)
        # Megatron layout: per group, [per_group query heads, 1 key head, 1 value head].
        qkv = ref_linear(params, p + "self_attention.linear_qkv", y).view(
            batch, seq, groups, per_group + 2, d
        )
        q = qkv[:, :, :, :per_group].reshape(batch, seq, heads, d)
        k, v = qkv[:, :, :, per_group], qkv[:, :, :, per_group + 1]
        if config.position_embedding_type == "rope":
            q, k = ref_rope(config, q), ref_rope(config, k)
        head_outputs = []
        for head in range(heads):
            group = head // per_group
            scores = q[:, :, head] @ k[:, :, group].transpose(1, 2) / math.sqrt(d)
            scores = scores.masked_fill(~causal, float("-inf"))
            probs = torch.exp(scores - scores.amax(-1, keepdim=True))
            probs = probs / probs.sum(-1, keepdim=True)
            head_outputs.append(probs @ v[:, :, group])
        context = torch.cat(head_outputs, dim=-1)
        x = x + ref_linear(params, p + "self_attention.linear_proj", context)

        y = ref_norm(config, params, p + "pre_mlp_layernorm", x)
        y = ref_linear(params, p + "mlp.linear_fc1", y)
        if config.swiglu:
            a, b = y[..., : config.ffn_hidden_size], y[..., config.ffn_hidden_size :]
            y = a * torch.sigmoid(a) * b
        else:
            y = 0.5 * y * (1 + torch.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y**3)))
        x = x + ref_linear(params, p + "mlp.linear_fc2", y)
    x = ref_norm(config, params, "decoder.final_layernorm", x)
    output = params.get("output_layer.weight", params["embedding.word_embeddings.weight"])
    return x @ output.t()


REFERENCE_CONFIGS = {
    "gpt2": dict(),
    "rope_rmsnorm_swiglu_nobias_gqa": dict(
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        num_query_groups=2,
    ),
    "partial_rope_untied_gqa1": dict(
        position_embedding_type="rope",
        rotary_percent=0.5,
        rotary_base=500,
        num_query_groups=1,
        untie_embeddings_and_output_weights=True,
    ),
}


@pytest.mark.parametrize("name", list(REFERENCE_CONFIGS))
def test_matches_reference_forward(name):
    # A large init std and perturbed biases/norm weights so that a wrong layout, mask or
    # missing bias changes the logits well above the tolerance.
    config = tiny_config(init_method_std=0.2, **REFERENCE_CONFIGS[name])
    model = build(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    tokens = random_tokens(config)
    logits = model(tokens)
    expected = reference_forward(model, config, tokens)
    assert logits.abs().max() > 1.0  # the comparison is not between near-zero tensors
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)

    labels = random_tokens(config, seed=2)
    expected_losses = torch.logsumexp(expected, -1) - expected.gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(model(tokens, labels=labels), expected_losses, atol=1e-5, rtol=1e-5)


def test_output_shapes_and_loss():
    config = tiny_config()
    model = build(config)
    tokens, labels = random_tokens(config), random_tokens(config, seed=2)
    logits = model(tokens)
    assert logits.shape == (3, config.seq_length, config.padded_vocab_size)
    losses = model(tokens, labels=labels)
    assert losses.shape == (3, config.seq_length) and losses.dtype == torch.float32
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    torch.testing.assert_close(losses, expected.view_as(labels))


@pytest.mark.parametrize("untie", [False, True])
def test_fused_linear_cross_entropy_gives_the_same_losses_and_gradients(untie):
    """--cross-entropy-fusion-impl linear: the losses and every parameter's gradient equal the
    logits-then-cross-entropy path's (fp32, tied and untied output weights)."""
    plain_config = tiny_config(untie_embeddings_and_output_weights=untie)
    fused_config = tiny_config(untie_embeddings_and_output_weights=untie)
    fused_config = type(fused_config)(
        **{**fused_config.__dict__, "linear_cross_entropy_fusion": True}
    )
    plain, fused = build(plain_config), build(fused_config)
    assert fused.output_head.fused_linear and not plain.output_head.fused_linear
    tokens, labels = random_tokens(plain_config), random_tokens(plain_config, seed=2)
    mask = (torch.arange(labels.numel()).view_as(labels) % 3 != 0).float()
    losses = []
    for model in (plain, fused):
        per_token = model(tokens, labels=labels)
        (per_token * mask).sum().backward()
        losses.append(per_token.detach())
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
    grads = {name: param.grad for name, param in fused.named_parameters()}
    for name, param in plain.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, atol=1e-5, rtol=1e-4, msg=name)
    # Without labels the model still returns the logits.
    torch.testing.assert_close(fused(tokens), plain(tokens))


def test_explicit_position_ids_equal_default():
    for overrides in (dict(), dict(position_embedding_type="rope")):
        config = tiny_config(**overrides)
        model = build(config)
        tokens = random_tokens(config)
        position_ids = torch.arange(config.seq_length).expand_as(tokens)
        torch.testing.assert_close(model(tokens, position_ids=position_ids), model(tokens))


@pytest.mark.parametrize(
    "overrides", [dict(), dict(position_embedding_type="rope", num_query_groups=2)]
)
def test_causal(overrides):
    config = tiny_config(**overrides)
    model = build(config)
    tokens = random_tokens(config)
    changed = tokens.clone()
    t = 5
    changed[:, t] = (changed[:, t] + 1) % config.padded_vocab_size
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :t], after[:, :t], atol=0, rtol=0)
    assert not torch.allclose(before[:, t], after[:, t])


def test_tied_and_untied_output_weights():
    tied = build(tiny_config())
    assert tied.output_layer is None
    assert "output_layer.weight" not in tied.state_dict()
    assert tied.output_weight().data_ptr() == tied.embedding.word_embeddings.weight.data_ptr()

    untied = build(tiny_config(untie_embeddings_and_output_weights=True))
    assert untied.output_weight().data_ptr() != untied.embedding.word_embeddings.weight.data_ptr()
    assert untied.state_dict()["output_layer.weight"].shape == (40, 32)


def test_parameter_names():
    names = set(dict(build(tiny_config()).named_parameters()))
    expected_layer = [
        "input_layernorm.weight",
        "input_layernorm.bias",
        "self_attention.linear_qkv.weight",
        "self_attention.linear_qkv.bias",
        "self_attention.linear_proj.weight",
        "self_attention.linear_proj.bias",
        "pre_mlp_layernorm.weight",
        "pre_mlp_layernorm.bias",
        "mlp.linear_fc1.weight",
        "mlp.linear_fc1.bias",
        "mlp.linear_fc2.weight",
        "mlp.linear_fc2.bias",
    ]
    expected = {
        "embedding.word_embeddings.weight",
        "embedding.position_embeddings.weight",
        "decoder.final_layernorm.weight",
        "decoder.final_layernorm.bias",
    } | {f"decoder.layers.{i}.{n}" for i in range(2) for n in expected_layer}
    assert names == expected

    rope_names = set(dict(build(tiny_config(position_embedding_type="rope")).named_parameters()))
    assert "embedding.position_embeddings.weight" not in rope_names


def test_init_is_deterministic_and_has_megatron_statistics():
    config = tiny_config(num_layers=8, hidden_size=256, num_attention_heads=8, ffn_hidden_size=1024)
    model = build(config, seed=123)
    again = build(config, seed=123)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name

    std = config.init_method_std
    scaled = std / math.sqrt(2 * config.num_layers)
    params = dict(model.named_parameters())
    for name, param in params.items():
        if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            assert abs(param.std().item() / scaled - 1) < 0.03, name
        elif name.endswith(("linear_qkv.weight", "linear_fc1.weight", "embeddings.weight")):
            assert abs(param.std().item() / std - 1) < 0.03, name
        elif name.endswith(".bias"):
            assert torch.count_nonzero(param) == 0, name
        else:  # norm weights
            assert "layernorm" in name and torch.all(param == 1), name
        if param.dim() == 2:
            assert abs(param.mean().item()) < 0.1 * param.std().item(), name


def test_param_groups_for_weight_decay():
    model = build(tiny_config(untie_embeddings_and_output_weights=True))
    decay, no_decay = param_groups_for_weight_decay(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decay_names = {names[id(p)] for p in decay["params"]}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert decay_names | no_decay_names == set(names.values())
    assert all(n.endswith(".bias") or "layernorm" in n for n in no_decay_names)
    assert "embedding.word_embeddings.weight" in decay_names
    assert "output_layer.weight" in decay_names
    assert all(n.endswith(".weight") and "layernorm" not in n for n in decay_names)


def test_rejects_unset_vocab_and_long_sequences():
    with pytest.raises(ValueError, match="padded_vocab_size"):
        GPTModel(tiny_config(padded_vocab_size=0))
    config = tiny_config()
    model = build(config)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.zeros(1, config.max_position_embeddings + 1, dtype=torch.long))


def test_bf16_forward_runs():
    config = tiny_config(position_embedding_type="rope", normalization="RMSNorm", swiglu=True)
    model = build(config).to(torch.bfloat16)
    tokens = random_tokens(config)
    logits = model(tokens)
    assert logits.dtype == torch.bfloat16
    assert model(tokens, labels=tokens).dtype == torch.float32
