"""moe.expert_load: each MoE layer's tokens per expert over a logging window (training forwards
only, each counted once), collected by layer number, and how the log line states it."""

import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from megatron.model import GPTModel
from moe.config import MoEConfig
from moe.expert_load import (
    format_expert_load_line,
    gather_expert_load,
    load_spread,
    take_window_counts,
)
from moe.mlp_spec import MoEMlpSpec
from tests.moe.test_layers import make_layer, model_config

pytestmark = pytest.mark.usefixtures("reference_kernels")


@pytest.mark.parametrize("dropless", [True, False])
def test_window_sums_training_forwards_only(dropless):
    """Each training forward adds its counts (before capacity drops); evaluation and the
    recomputed forward of activation checkpointing add nothing."""
    layer = make_layer(top_k=2, dropless=dropless, capacity_factor=0.5)
    layer.train()
    expected = torch.zeros(4, dtype=torch.long)
    for seed in range(3):
        x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(seed))
        layer(x)
        expected += layer.tokens_per_expert
    assert int(expected.sum()) == 3 * 16 * 2  # every assignment, dropped ones included
    x = torch.randn(2, 8, 16, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    expected += layer.tokens_per_expert
    layer.eval()
    layer(torch.randn(2, 8, 16))
    assert torch.equal(layer.window_tokens_per_expert, expected)


def test_window_is_not_saved_in_checkpoints():
    assert "window_tokens_per_expert" not in make_layer().state_dict()


def _model(layer_freq):
    config = model_config(num_layers=4, padded_vocab_size=64)
    torch.manual_seed(0)
    return GPTModel(config, MoEMlpSpec(MoEConfig(num_experts=4, top_k=2, layer_freq=layer_freq)))


def test_counts_are_taken_by_layer_number_and_cleared():
    model = _model(layer_freq=2)  # MoE layers 0 and 2
    tokens = torch.randint(0, 64, (3, 8))
    model(tokens, labels=tokens)
    model(tokens, labels=tokens)
    counts = take_window_counts(model)
    assert sorted(counts) == [0, 2]
    assert all(int(layer_counts.sum()) == 2 * 3 * 8 * 2 for layer_counts in counts.values())
    assert all(int(layer_counts.sum()) == 0 for layer_counts in take_window_counts(model).values())
    model(tokens, labels=tokens)
    load = gather_expert_load(model, [0, 2], 4, torch.device("cpu"))
    assert sorted(load) == [0, 2] and load[0].dtype == torch.int64
    assert torch.equal(load[2], model.decoder.layers[2].mlp.tokens_per_expert)


def test_load_spread_and_log_line():
    assert load_spread(torch.tensor([4, 4, 4, 4])) == (1.0, 1.0)
    assert load_spread(torch.tensor([16, 0, 0, 0])) == (4.0, 0.0)
    assert all(math.isnan(value) for value in load_spread(torch.zeros(4, dtype=torch.long)))
    line = format_expert_load_line({0: torch.tensor([6, 2, 4, 4]), 2: torch.tensor([4, 4, 4, 4])})
    assert line == (
        " expert load (max / min tokens per expert over the mean) |"
        " layer 0: 1.50 / 0.50 | layer 2: 1.00 / 1.00 |"
    )
