"""--use-precision-aware-optimizer and --optimizer-cpu-offload at the optimizer: PrecisionAwareAdamW
against torch's AdamW, bf16 moments and main gradients against the fp32 step (bounded as bf16's
rounding predicts), state dicts across dtypes, and the host-offloaded update against the on-device
one."""

from __future__ import annotations

import copy
from typing import List

import pytest
import torch
from torch import nn

from megatron.config import OptimizerConfig
from megatron.main_grads import gradient
from megatron.optimizer import build_optimizer
from megatron.optimizer.precision import PrecisionAwareAdamW, offloaded_share
from tests.markers import gpu
from tests.optimizer.test_optimizer import batches, tiny_model, training

BF16_STATE = dict(
    use_precision_aware_optimizer=True,
    main_grads_dtype="bf16",
    exp_avg_dtype="bf16",
    exp_avg_sq_dtype="bf16",
)


def _config(**overrides) -> OptimizerConfig:
    fields = dict(lr=1e-2, weight_decay=0.1, clip_grad=0.0, adam_beta2=0.95)
    fields.update(overrides)
    return OptimizerConfig(**fields)


def _step(model: nn.Module, optimizer, inputs: List[torch.Tensor]) -> None:
    """One optimizer step over `inputs` as micro-batches (gradient accumulation)."""
    optimizer.zero_grad()
    for micro_batch in inputs:
        (model(micro_batch).square().mean() / len(inputs)).backward()
    optimizer.step()


def _parameters(model: nn.Module) -> List[torch.Tensor]:
    return [param.detach().clone() for param in model.parameters()]


def test_fp32_state_is_torch_adamw_bit_for_bit():
    """With fp32 moments the precision-aware optimizer is torch's AdamW (single-tensor), with
    its weight-decay groups, over several steps."""
    model = tiny_model()
    reference = copy.deepcopy(model)
    ours = build_optimizer(model, _config(use_precision_aware_optimizer=True), training())
    assert isinstance(ours.optimizer, PrecisionAwareAdamW)
    theirs = build_optimizer(reference, _config(), training())
    for group in theirs.optimizer.param_groups:
        group["foreach"], group["fused"] = False, False  # torch's single-tensor formula
    for inputs in batches(4):
        _step(model, ours, [inputs])
        _step(reference, theirs, [inputs])
    for one, two in zip(model.parameters(), reference.parameters()):
        assert torch.equal(one, two)


def test_bf16_moments_and_gradients_step_within_bf16_rounding():
    """One step from the same warm state (three fp32 steps), with bf16 main gradients (two
    micro-batches accumulated) and bf16 moments, against the fp32 step. bf16 keeps 8
    significant bits: rounding relative error at most u = 2**-8. The moments are stored rounded
    (m's error u reaches the update m / sqrt(v) whole, v's by half) and the gradient enters m
    with weight 1 - beta1 = 0.1: the update, whose arithmetic is fp32, differs by at most about
    1.5u relative. Measured as the L2 norm over the model it is about 0.4u here."""
    model = tiny_model()
    warm = build_optimizer(model, _config(), training())
    for inputs in batches(3, seed=10):
        _step(model, warm, [inputs])
    reference = copy.deepcopy(model)
    low = build_optimizer(model, _config(**BF16_STATE), training())
    full = build_optimizer(reference, _config(), training())
    low.load_state_dict(copy.deepcopy(warm.state_dict()))
    full.load_state_dict(copy.deepcopy(warm.state_dict()))
    before = _parameters(model)
    inputs = batches(2, seed=20)
    _step(model, low, inputs)
    _step(reference, full, inputs)
    assert all(gradient(p).dtype == torch.bfloat16 for p in model.parameters())
    state = low.optimizer.state[next(model.parameters())]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    low_update = torch.cat([(p.detach() - s).flatten() for s, p in zip(before, model.parameters())])
    full_update = torch.cat(
        [(p.detach() - s).flatten() for s, p in zip(before, reference.parameters())]
    )
    assert all(p.dtype == torch.float32 for p in model.parameters())
    relative = float((low_update - full_update).norm() / full_update.norm())
    assert 0.0 < relative <= 1.5 * 2.0**-8, relative


def test_state_round_trips_in_each_dtype_and_converts_between_them():
    model = tiny_model()
    low = build_optimizer(model, _config(**BF16_STATE), training())
    _step(model, low, batches(1))
    saved = copy.deepcopy(low.state_dict())
    assert saved["optimizer"]["state"][0]["exp_avg"].dtype == torch.bfloat16

    again = build_optimizer(copy.deepcopy(model), _config(**BF16_STATE), training())
    again.load_state_dict(saved)
    assert again.optimizer.loaded_state_conversion is None
    for one, two in zip(
        saved["optimizer"]["state"].values(), again.state_dict()["optimizer"]["state"].values()
    ):
        assert (
            torch.equal(one["exp_avg"], two["exp_avg"])
            and one["exp_avg"].dtype == two["exp_avg"].dtype
        )

    # bf16 -> fp32 (torch's AdamW) and fp32 -> bf16: converted, and said so.
    plain = build_optimizer(copy.deepcopy(model), _config(), training())
    plain.load_state_dict(saved)
    assert (
        plain.optimizer.loaded_state_conversion == "exp_avg bf16 -> fp32, exp_avg_sq bf16 -> fp32"
    )
    entry = plain.optimizer.state[next(iter(plain.optimizer.state))]
    assert entry["exp_avg"].dtype == torch.float32
    back = build_optimizer(copy.deepcopy(model), _config(**BF16_STATE), training())
    back.load_state_dict(plain.state_dict())
    assert back.optimizer.loaded_state_conversion == "exp_avg fp32 -> bf16, exp_avg_sq fp32 -> bf16"
    for one, two in zip(
        saved["optimizer"]["state"].values(), back.state_dict()["optimizer"]["state"].values()
    ):
        assert torch.equal(one["exp_avg"], two["exp_avg"])  # bf16 -> fp32 -> bf16 is exact


FP32_STATE = dict(use_precision_aware_optimizer=True)


def _offload_against_device(device: str, fraction: float, state: dict) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 32)).to(device)
    offloaded_model = copy.deepcopy(model)
    before = _parameters(model)
    on_device = build_optimizer(model, _config(**state), training())
    offloaded = build_optimizer(
        offloaded_model,
        _config(**state, optimizer_cpu_offload=True, optimizer_offload_fraction=fraction),
        training(),
    )
    inner = offloaded.optimizer
    expected = offloaded_share(list(offloaded_model.parameters()), fraction)
    assert [inner.is_offloaded(p) for p in offloaded_model.parameters()] == [
        any(p is q for q in expected) for p in offloaded_model.parameters()
    ]
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        inputs = [torch.randn(8, 64, generator=generator).to(device) for _ in range(2)]
        _step(model, on_device, inputs)
        _step(offloaded_model, offloaded, inputs)
    for param in offloaded_model.parameters():
        if inner.is_offloaded(param):
            assert inner.state[param]["exp_avg"].device.type == "cpu"
    # The host runs torch's fused CPU AdamW, the device this project's kernel or reference:
    # the same fp32 formula, rounded in another order. With fp32 moments the weights agree to
    # fp32 rounding; bf16 moments may round the other way where the fp32 values differ in
    # their last bit, so the update then agrees to bf16's rounding (u = 2**-8), as in
    # test_bf16_moments_and_gradients_step_within_bf16_rounding.
    for one, two in zip(model.parameters(), offloaded_model.parameters()):
        assert one.device == two.device
    if state is FP32_STATE:
        for one, two in zip(model.parameters(), offloaded_model.parameters()):
            torch.testing.assert_close(one, two, rtol=1e-5, atol=1e-7)
    else:
        updates = [
            torch.cat([(p.detach() - s).flatten() for s, p in zip(before, m.parameters())])
            for m in (model, offloaded_model)
        ]
        relative = float((updates[0] - updates[1]).norm() / updates[0].norm())
        assert relative <= 2.0**-8, relative


@pytest.mark.parametrize("state", [FP32_STATE, BF16_STATE], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_offloaded_update_equals_the_on_device_one(fraction, state):
    _offload_against_device("cpu", fraction, state)


def test_offloaded_share_takes_parameters_in_order():
    params = [torch.zeros(n) for n in (10, 30, 60)]
    assert offloaded_share(params, 0.0) == []
    assert [p.numel() for p in offloaded_share(params, 0.1)] == [10]
    assert [p.numel() for p in offloaded_share(params, 0.2)] == [10, 30]
    assert [p.numel() for p in offloaded_share(params, 1.0)] == [10, 30, 60]


@gpu
@pytest.mark.parametrize("state", [FP32_STATE, BF16_STATE], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_offloaded_update_equals_the_on_gpu_one(fraction, state):
    _offload_against_device("cuda", fraction, state)
