"""The fixed-size expert-parallel blocks' factor (moe.block_factor): grown to fit a step's
routing, shrunk after a stretch of steps that needed much less, on a ladder so that a factor
met before reuses its compiled graph; and the MoE training hooks applying it to the layers."""

from __future__ import annotations

import torch

from moe.block_factor import FACTOR_STEP, SHRINK_WINDOW, BlockFactor, on_ladder
from moe.config import MoEConfig
from moe.layers import build_moe_layer, moe_layers
from moe.training_hooks import MoETrainingHooks
from tests.tiny_gpt import moe_layer_model_config


def test_factors_lie_on_the_ladder():
    assert on_ladder(1.0) == 1.0
    assert on_ladder(0.3) == 1.0  # never below the balanced share
    assert on_ladder(1.01) == 1.25
    assert on_ladder(2.0000000001) == 2.0
    assert on_ladder(4.39) == 4.5
    assert all(on_ladder(f) / FACTOR_STEP == int(on_ladder(f) / FACTOR_STEP) for f in (1.3, 2.7))


def test_grows_above_the_need_and_shrinks_only_after_a_window_of_smaller_needs():
    factor = BlockFactor(1.5)
    assert factor.grown(1.5 * 1.22) == 2.25  # 1.83 x 1.1 = 2.01, up to the ladder
    assert factor.grown(3.4) == 3.75
    # Fewer than SHRINK_WINDOW steps decide nothing, however small their need.
    assert all(factor.after_step(1.2) is None for _ in range(SHRINK_WINDOW - 1))
    # The window's largest need (1.7, once) decides: 1.87 -> 2.0.
    assert factor.after_step(1.7) == (1.7, 2.0)
    assert factor.factor == 2.0
    # A window that needed about what the blocks hold keeps them.
    assert all(factor.after_step(1.9) is None for _ in range(SHRINK_WINDOW))
    assert factor.factor == 2.0
    # A growth starts a new window: the steps before it do not count toward a shrink.
    for _ in range(SHRINK_WINDOW - 1):
        factor.after_step(1.0)
    factor.grown(2.1)
    assert factor.after_step(1.0) is None and factor.factor == 2.5


def _hooks_and_model(start: float):
    moe = MoEConfig(num_experts=4, top_k=1, expert_parallel_buffer_factor=start)
    model = torch.nn.ModuleList(
        [build_moe_layer(moe_layer_model_config(32, 64, 16), moe) for _ in range(2)]
    )
    return MoETrainingHooks(moe, None, num_layers=2, writes_metrics=False), model


def _step(hooks, model, needs):
    """One step as the trainer runs it: the layers record what their blocks needed
    ([over the block size, over the balanced share], as a forward does), then the hooks
    decide."""
    assert hooks.before_step(model)
    for (_, layer), need in zip(moe_layers(model), needs):
        layer.step_block_need.copy_(torch.tensor(need, dtype=torch.float64))
    return hooks.rerun_step(model)


def test_hooks_grow_the_layers_blocks_and_shrink_them_later(capsys):
    hooks, model = _hooks_and_model(1.5)

    def factors():
        return {layer.expert_parallel_buffer_factor for _, layer in moe_layers(model)}

    # The fullest block of either layer decides for both.
    note = _step(hooks, model, [(0.5, 0.75), (1.2, 1.8)])
    assert "1.20x too small" in note and "grows from 1.5 to 2.0" in note
    assert factors() == {2.0}
    assert all(float(layer.step_block_need.max()) == 0 for _, layer in moe_layers(model))
    for _ in range(SHRINK_WINDOW - 1):
        assert _step(hooks, model, [(0.6, 1.2), (0.4, 0.8)]) is None
    assert factors() == {2.0} and "shrink" not in capsys.readouterr().out
    assert _step(hooks, model, [(0.6, 1.2), (0.4, 0.8)]) is None
    said = capsys.readouterr().out
    assert "needed at most 1.20x the balanced share" in said
    assert "the buffer factor goes from 2.0 to 1.5" in said
    assert factors() == {1.5}


def test_without_fixed_size_blocks_there_is_nothing_to_decide():
    hooks, model = _hooks_and_model(None)
    assert hooks.block_factor is None and not hooks.before_step(model)
