"""Activation recomputation must not change the loss or any gradient."""

from __future__ import annotations

import pytest
import torch

from megatron.config import ModelConfig
from megatron.model import GPTModel

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
    model = GPTModel(config).train()
    tokens = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)  # same dropout masks in every run
    loss = model(tokens, labels=tokens.roll(-1, dims=1)).mean()
    loss.backward()
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
    with pytest.raises(ValueError, match="recompute_method"):
        GPTModel(ModelConfig(**base, recompute_num_layers=1))
    with pytest.raises(ValueError, match="recompute_num_layers"):
        GPTModel(ModelConfig(**base, recompute_method="uniform"))
