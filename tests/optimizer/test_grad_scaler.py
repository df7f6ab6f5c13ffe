"""Megatron's dynamic loss-scale rule, step by step."""

from __future__ import annotations

import torch

from megatron.optimizer import ConstantGradScaler, DynamicGradScaler


def trace(scaler: DynamicGradScaler, overflows: str) -> list:
    """Apply updates ('x' overflow, '.' clean) and record (scale, growth, hysteresis) after each."""
    states = []
    for symbol in overflows:
        scaler.update(symbol == "x")
        states.append((scaler.scale, scaler.growth_tracker, scaler.hysteresis_tracker))
    return states


def test_overflow_hysteresis_backoff_floor_and_growth():
    scaler = DynamicGradScaler(1024.0, min_scale=256.0, growth_interval=3, hysteresis=2)
    assert trace(scaler, "xxxx..x...x") == [
        (1024.0, 0, 1),  # first overflow uses up hysteresis only
        (512.0, 0, 0),  # hysteresis spent: back off
        (256.0, 0, -1),  # every further overflow backs off again
        (256.0, 0, -2),  # ...but never below min_scale
        (256.0, 1, -2),
        (256.0, 2, -2),
        (256.0, 0, -3),  # an overflow resets the growth count
        (256.0, 1, -3),
        (256.0, 2, -3),
        (512.0, 0, 2),  # 3 clean steps: grow and refill the hysteresis
        (512.0, 0, 1),  # so the next overflow is tolerated
    ]


def test_state_round_trip_and_megatron_tensor_scale():
    scaler = DynamicGradScaler(2.0**16, min_scale=1.0, growth_interval=4, hysteresis=3)
    trace(scaler, "x..")
    restored = DynamicGradScaler(2.0**16, min_scale=1.0, growth_interval=4, hysteresis=3)
    restored.load_state_dict(scaler.state_dict())
    assert trace(restored, ".x..") == trace(scaler, ".x..")
    restored.load_state_dict({"scale": torch.tensor([8.0]), "growth_tracker": 1,
                              "hysteresis_tracker": 2})  # fmt: skip
    assert (restored.scale, restored.growth_tracker, restored.hysteresis_tracker) == (8.0, 1, 2)


def test_constant_scaler_never_changes():
    scaler = ConstantGradScaler(128.0)
    for found_inf in (True, True, False):
        scaler.update(found_inf)
    assert (scaler.scale, scaler.inv_scale, scaler.state_dict()) == (128.0, 1 / 128.0, {})
