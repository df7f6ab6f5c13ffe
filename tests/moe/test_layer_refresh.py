"""The expert weights' compute copies refreshed layer by layer (moe.training_hooks), as the
trainer asks when each layer's weights arrive only just before its forward
(--overlap-param-gather): before_forwards leaves the copies alone, each layer's first forward
refreshes its own, once."""

from __future__ import annotations

import torch

from megatron.parallelize.data_parallel_mode import data_parallel_mode
from moe.config import MoEConfig
from moe.experts import expert_modules
from moe.layers import build_moe_layer
from moe.training_hooks import MoETrainingHooks
from tests.config.command_lines import config
from tests.tiny_gpt import moe_layer_model_config


def test_each_layer_refreshes_its_copies_once_its_weights_are_there():
    moe = MoEConfig(num_experts=4, top_k=1)
    model = torch.nn.ModuleList(
        [build_moe_layer(moe_layer_model_config(32, 64, 16), moe) for _ in range(2)]
    )
    hooks = MoETrainingHooks(moe, torch.bfloat16, num_layers=2, writes_metrics=False)
    hooks.setup(model, data_parallel_mode(config()), torch.device("cpu"))
    hooks.weights_arrive_by_layer()

    def copies(layer):
        return [
            copy.clone() for copy in expert_modules(layer)[0]._compute_weights if copy is not None
        ]

    hooks.before_forwards(model)
    assert all(expert._compute_weights is None for expert in expert_modules(model))
    for layer in model:
        hooks.before_layer_forward(layer)
    first = [copies(layer) for layer in model]
    # The optimizer's step changes the weights; the next forwards must see the new ones.
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    hooks.before_forwards(model)
    assert all(torch.equal(a, b) for a, b in zip(copies(model[1]), first[1]))  # not yet
    hooks.before_layer_forward(model[0])
    expected = [w.to(torch.bfloat16) for w in expert_modules(model[0])[0].projection_weights()[::2]]
    assert all(torch.equal(a, b) for a, b in zip(copies(model[0]), expected))
    assert all(torch.equal(a, b) for a, b in zip(copies(model[1]), first[1]))  # still its own
    hooks.before_layer_forward(model[1])
    assert not any(torch.equal(a, b) for a, b in zip(copies(model[1]), first[1]))
    # A forward recomputed in the backward (or a second micro-batch) refreshes nothing.
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    hooks.before_layer_forward(model[0])
    assert all(torch.equal(a, b) for a, b in zip(copies(model[0]), expected))
