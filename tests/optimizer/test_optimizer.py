"""MegatronOptimizer on a tiny model: overflow skip, clipping, weight-decay groups, AdamW parity,
checkpoint round trip, and the cross-rank overflow agreement (two gloo processes)."""

from __future__ import annotations

import copy
import io
from typing import List

import pytest
import torch
from torch import nn

from megatron.config import OptimizerConfig, TrainingConfig
from megatron.optimizer import (
    ConstantGradScaler,
    DynamicGradScaler,
    build_lr_scheduler,
    build_optimizer,
)
from tests.launch import run_distributed


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 3))


def training(**overrides) -> TrainingConfig:
    fields = dict(micro_batch_size=2, global_batch_size=4, num_micro_batches=2, train_iters=50)
    fields.update(overrides)
    return TrainingConfig(**fields)


def batches(count: int, seed: int = 1) -> List[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 4, generator=generator) for _ in range(count)]


def backward(model: nn.Module, optimizer, inputs: torch.Tensor) -> None:
    """Forward and backward of a fixed loss; `optimizer` may be a plain torch optimizer."""
    optimizer.zero_grad()
    loss = model(inputs).square().mean()
    scale_loss = getattr(optimizer, "scale_loss", lambda unscaled: unscaled)
    scale_loss(loss).backward()


def parameters(model: nn.Module) -> List[torch.Tensor]:
    return [param.detach().clone() for param in model.parameters()]


def assert_bit_equal(first: List[torch.Tensor], second: List[torch.Tensor]) -> None:
    assert len(first) == len(second)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_groups_split_decay_from_bias_and_norm():
    model = tiny_model()
    optimizer = build_optimizer(model, OptimizerConfig(lr=0.1, weight_decay=0.3), training())
    decay, no_decay = optimizer.param_groups
    assert [p.shape for p in decay["params"]] == [(8, 4), (3, 8)]
    assert len(no_decay["params"]) == 4  # two biases, LayerNorm weight and bias
    assert (decay["wd_mult"], no_decay["wd_mult"]) == (1.0, 0.0)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.3, 0.0)
    assert (decay["betas"], decay["eps"]) == ((0.9, 0.999), 1e-8)
    assert isinstance(optimizer.optimizer, torch.optim.AdamW)
    sgd = build_optimizer(
        model, OptimizerConfig(lr=0.1, optimizer="sgd", sgd_momentum=0.7), training()
    )
    assert isinstance(sgd.optimizer, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.7


def test_no_weight_decay_on_bias_and_norm():
    model = tiny_model()
    optimizer = build_optimizer(model, OptimizerConfig(lr=0.1, weight_decay=0.5), training())
    # The scheduler rewrites weight_decay every step; wd_mult keeps biases/norms at 0.
    build_lr_scheduler(optimizer, OptimizerConfig(lr=0.1, weight_decay=0.5), training())
    before = dict(model.named_parameters())
    before = {name: param.detach().clone() for name, param in before.items()}
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    assert optimizer.step()[0]
    for name, param in model.named_parameters():
        if name.endswith(".bias") or param.dim() == 1:
            assert torch.equal(param, before[name]), name
        else:
            # AdamW with zero gradients: only the decoupled decay p *= 1 - lr * wd acts.
            assert torch.equal(param, before[name] * (1 - 0.1 * 0.5)), name


def test_adamw_matches_torch_reference_step_for_step():
    config = OptimizerConfig(
        lr=3e-3, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6, clip_grad=0.0
    )
    model, reference_model = tiny_model(), tiny_model()
    optimizer = build_optimizer(model, config, training())
    decay = [p for n, p in reference_model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in reference_model.named_parameters() if p.dim() == 1]
    reference = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-3, betas=(0.8, 0.95), eps=1e-6,
    )  # fmt: skip
    for inputs in batches(6):
        backward(model, optimizer, inputs)
        backward(reference_model, reference, inputs)
        successful, grad_norm, num_zeros = optimizer.step()
        reference.step()
        assert successful and grad_norm > 0 and num_zeros is None
        assert_bit_equal(parameters(model), parameters(reference_model))


def test_clipping_scales_to_clip_grad_and_reports_the_norm_before():
    model = tiny_model()
    optimizer = build_optimizer(model, OptimizerConfig(lr=0.0, clip_grad=1.0), training())
    for index, param in enumerate(model.parameters()):
        param.grad = torch.full_like(param, float(index + 1))
    expected = sum(
        float((index + 1) ** 2 * p.numel()) for index, p in enumerate(model.parameters())
    )
    successful, grad_norm, _ = optimizer.step()
    assert successful and grad_norm == pytest.approx(expected**0.5, rel=1e-6)
    grads = [param.grad for param in model.parameters()]
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert clipped.item() == pytest.approx(1.0, rel=1e-5)

    # Below the threshold nothing changes.
    small = [torch.full_like(param, 1e-3) for param in model.parameters()]
    for param, grad in zip(model.parameters(), small):
        param.grad = grad.clone()
    optimizer.step()
    assert_bit_equal([param.grad for param in model.parameters()], small)


def test_fp16_overflow_skips_update_and_backs_off_after_hysteresis():
    config = OptimizerConfig(lr=0.1, initial_loss_scale=2.0**16, hysteresis=2)
    model = tiny_model()
    optimizer = build_optimizer(model, config, training(fp16=True))
    assert isinstance(optimizer.grad_scaler, DynamicGradScaler) and optimizer.loss_scale == 2.0**16
    before = parameters(model)
    for expected_scale in (2.0**16, 2.0**15):
        backward(model, optimizer, batches(1)[0])
        next(model.parameters()).grad[0, 0] = float("inf")
        assert optimizer.step() == (False, None, None)
        assert_bit_equal(parameters(model), before)
        assert optimizer.optimizer.state == {}  # AdamW did not step
        assert optimizer.loss_scale == expected_scale


def test_fp16_clean_step_equals_fp32_step_and_constant_scale():
    # Scaling by a power of two and unscaling is exact, so the updates must agree bit for bit.
    inputs = batches(3)
    runs = []
    for fp16, loss_scale in ((False, None), (True, None), (True, 1024.0)):
        model = tiny_model()
        config = OptimizerConfig(lr=0.01, initial_loss_scale=2.0**12, loss_scale=loss_scale)
        optimizer = build_optimizer(model, config, training(fp16=fp16))
        norms = []
        for batch in inputs:
            backward(model, optimizer, batch)
            successful, grad_norm, _ = optimizer.step()
            assert successful
            norms.append(grad_norm)
        runs.append((parameters(model), norms))
    assert isinstance(optimizer.grad_scaler, ConstantGradScaler) and optimizer.loss_scale == 1024.0
    for params, norms in runs[1:]:
        assert_bit_equal(params, runs[0][0])
        assert norms == runs[0][1]


def test_bf16_nan_gradient_is_not_skipped_but_reported():
    model = tiny_model()
    optimizer = build_optimizer(model, OptimizerConfig(lr=0.1), training(bf16=True))
    loss = model(batches(1)[0]).sum()
    assert optimizer.loss_scale == 1.0 and optimizer.scale_loss(loss) is loss
    loss.backward()
    next(model.parameters()).grad[0, 0] = float("nan")
    successful, grad_norm, _ = optimizer.step()
    assert successful and grad_norm != grad_norm  # nan


def test_num_zeros_in_grad():
    model = tiny_model()
    optimizer = build_optimizer(
        model, OptimizerConfig(lr=0.1), training(), log_num_zeros_in_grad=True
    )
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    next(model.parameters()).grad[0] = 0.0  # one row of 4
    assert optimizer.step()[2] == 4


def test_state_round_trip_continues_bit_exactly():
    optimizer_config = OptimizerConfig(lr=0.01, lr_warmup_iters=2, lr_decay_style="cosine",
                                       initial_loss_scale=2.0**10, loss_scale_window=2)  # fmt: skip
    training_config = training(fp16=True)
    inputs = batches(6)

    def build(model):
        optimizer = build_optimizer(model, optimizer_config, training_config)
        return optimizer, build_lr_scheduler(optimizer, optimizer_config, training_config)

    def train(model, optimizer, scheduler, steps):
        for batch in steps:
            backward(model, optimizer, batch)
            if optimizer.step()[0]:
                scheduler.step(increment=training_config.global_batch_size)

    model = tiny_model()
    optimizer, scheduler = build(model)
    train(model, optimizer, scheduler, inputs[:3])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict()}, buffer)  # fmt: skip
    train(model, optimizer, scheduler, inputs[3:])

    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)
    resumed = tiny_model(seed=7)
    resumed.load_state_dict(checkpoint["model"])
    resumed_optimizer, resumed_scheduler = build(resumed)
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    resumed_scheduler.load_state_dict(checkpoint["scheduler"])
    assert resumed_optimizer.loss_scale == 2.0**11  # grown once during the first 3 steps
    train(resumed, resumed_optimizer, resumed_scheduler, inputs[3:])

    assert_bit_equal(parameters(resumed), parameters(model))
    assert resumed_optimizer.loss_scale == optimizer.loss_scale
    assert resumed_scheduler.state_dict() == scheduler.state_dict()
    assert resumed_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]


def _overflow_on_one_rank(rank: int, world_size: int) -> tuple:
    model = tiny_model()
    optimizer = build_optimizer(model, OptimizerConfig(lr=0.1), training(fp16=True))
    before = parameters(model)
    backward(model, optimizer, batches(1)[0])
    if rank == 1:
        next(model.parameters()).grad[0, 0] = float("nan")
    successful, _, _ = optimizer.step()
    unchanged = all(torch.equal(a, b) for a, b in zip(parameters(model), before))
    return successful, unchanged


def test_overflow_on_one_rank_skips_the_step_on_all_ranks():
    assert run_distributed(_overflow_on_one_rank, 2) == [(False, True), (False, True)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_fused_adamw_on_gpu_matches_cpu():
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1)
    cpu_model = tiny_model()
    gpu_model = copy.deepcopy(cpu_model).cuda()
    cpu_optimizer = build_optimizer(cpu_model, config, training())
    gpu_optimizer = build_optimizer(gpu_model, config, training())
    assert gpu_optimizer.param_groups[0].get("fused") is True
    for inputs in batches(4):
        backward(cpu_model, cpu_optimizer, inputs)
        backward(gpu_model, gpu_optimizer, inputs.cuda())
        _, cpu_norm, _ = cpu_optimizer.step()
        _, gpu_norm, _ = gpu_optimizer.step()
        assert gpu_norm == pytest.approx(cpu_norm, rel=1e-5)
    for cpu_param, gpu_param in zip(cpu_model.parameters(), gpu_model.parameters()):
        torch.testing.assert_close(gpu_param.cpu(), cpu_param, rtol=1e-5, atol=1e-6)
    # A GPU checkpoint loads on CPU and keeps the CPU kernel choice.
    state = gpu_optimizer.state_dict()
    cpu_optimizer.load_state_dict(
        {"optimizer": {"state": {k: {n: t.cpu() for n, t in v.items()}
                                 for k, v in state["optimizer"]["state"].items()},
                       "param_groups": state["optimizer"]["param_groups"]}}
    )  # fmt: skip
    assert not cpu_optimizer.param_groups[0].get("fused")
