"""Activation recomputation (megatron.parallelize.steps.apply_activation_recomputation) must not change
the loss or any gradient, and must actually recompute."""

from __future__ import annotations

import pytest
import torch

from megatron.config import ModelConfig
from megatron.model import GPTModel
from megatron.parallelize.steps import apply_activation_recomputation

RECOMPUTE_SETTINGS = {
    "full_uniform_2": dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2
    ),
    "full_uniform_1": dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    ),
    "full_block_2": dict(
        recompute_granularity="full", recompute_method="block", recompute_num_layers=2
    ),
    "selective": dict(recompute_granularity="selective"),
}


def loss_and_grads(dropout: float, **recompute):
    config = ModelConfig(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        seq_length=10,
        max_position_embeddings=10,
        padded_vocab_size=50,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        position_embedding_type="rope",
        num_query_groups=2,
        **recompute,
    )
    torch.manual_seed(0)
    model = apply_activation_recomputation(GPTModel(config), config).train()
    mlp_forwards = []
    model.decoder.layers[0].mlp.register_forward_pre_hook(lambda *_: mlp_forwards.append(1))
    tokens = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)  # same dropout masks in every run
    loss = model(tokens, labels=tokens.roll(-1, dims=1)).mean()
    loss.backward()
    # Full recompute runs the first layer's forward again in backward; the others once.
    assert len(mlp_forwards) == (2 if config.recompute_granularity == "full" else 1)
    selective = config.recompute_granularity == "selective"
    assert model.decoder.layers[0].self_attention.core_attention.recompute == selective
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("name", list(RECOMPUTE_SETTINGS))
def test_recompute_matches_no_recompute(name, dropout):
    expected_loss, expected_grads = loss_and_grads(dropout)
    loss, grads = loss_and_grads(dropout, **RECOMPUTE_SETTINGS[name])
    torch.testing.assert_close(loss, expected_loss, atol=1e-6, rtol=1e-6)
    for param_name, grad in expected_grads.items():
        torch.testing.assert_close(grads[param_name], grad, atol=1e-6, rtol=1e-6, msg=param_name)


def test_full_recompute_needs_method_and_layers():
    base = dict(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        seq_length=4,
        max_position_embeddings=4,
        padded_vocab_size=8,
        recompute_granularity="full",
    )
    for fields, missing in (
        (dict(recompute_num_layers=1), "recompute_method"),
        (dict(recompute_method="uniform"), "recompute_num_layers"),
    ):
        config = ModelConfig(**base, **fields)
        with pytest.raises(ValueError, match=missing):
            apply_activation_recomputation(GPTModel(config), config)
