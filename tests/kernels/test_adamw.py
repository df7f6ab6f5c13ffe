"""adamw_step_ (one AdamW step on fp32 weights with fp32 or bf16 gradient and moments): the Triton
kernel (interpreter on CPU, real on GPU) against the PyTorch reference, which computes torch's
single-tensor AdamW in fp32. They differ only by fused multiply-adds: the weights agree to a
few fp32 ulps of the update and the moments to one rounding in their dtype."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron.kernels import adamw as module  # noqa: E402
from megatron.kernels.adamw import (  # noqa: E402
    AdamWHyper,
    adamw_step_,
    adamw_step_reference_,
)
from tests.markers import gpu  # noqa: E402

interpreted = pytest.mark.usefixtures("triton_kernels")

HYPER = AdamWHyper(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3)


@pytest.fixture
def launches(monkeypatch):
    """Counts kernel launches, proving the kernel (not the reference) ran."""
    count = {"n": 0}
    original = module._adamw_kernel.run

    def run(*args, **kwargs):
        count["n"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module._adamw_kernel, "run", run)
    return count


def _state(numel, grad_dtype, avg_dtype, avg_sq_dtype, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    param = torch.randn(numel, generator=generator)
    grad = torch.randn(numel, generator=generator) * 1e-3
    exp_avg = torch.randn(numel, generator=generator) * 1e-3
    exp_avg_sq = torch.rand(numel, generator=generator) * 1e-6
    return [
        param.to(device),
        grad.to(device, grad_dtype),
        exp_avg.to(device, avg_dtype),
        exp_avg_sq.to(device, avg_sq_dtype),
    ]


def _compare(numel, dtypes, device):
    kernel_state = _state(numel, *dtypes, device=device)
    reference_state = [tensor.clone() for tensor in kernel_state]
    before = kernel_state[0].clone()
    # What each moment is computed from: rounding errors scale with these, not with the result
    # (the first moment may nearly cancel).
    scale = kernel_state[1].float().abs() + kernel_state[2].float().abs()
    scales = [scale, kernel_state[1].float().square() + kernel_state[3].float()]
    adamw_step_(*kernel_state, HYPER)
    adamw_step_reference_(*reference_state, HYPER)
    update = (reference_state[0] - before).abs()
    # The weight: a few ulps of the update (the fused multiply-adds) on top of one of the weight.
    weight_error = (kernel_state[0] - reference_state[0]).abs()
    assert torch.all(weight_error <= 1e-5 * update + 2.0**-23 * before.abs() * 2), (
        weight_error.max()
    )
    for kernel_moment, reference_moment, scale in zip(
        kernel_state[2:], reference_state[2:], scales
    ):
        # One rounding in the moment's dtype, on top of a few fp32 ulps of its inputs.
        ulp = torch.finfo(kernel_moment.dtype).eps
        difference = (kernel_moment.float() - reference_moment.float()).abs()
        bound = ulp * reference_moment.float().abs() + 4 * 2.0**-23 * scale
        assert torch.all(difference <= bound), (difference - bound).max()


@interpreted
@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.float32, torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16, torch.float32),
    ],
)
def test_kernel_matches_reference_in_the_interpreter(dtypes, launches):
    _compare(5000, dtypes, "cpu")  # not a multiple of the block: the masked tail
    assert launches["n"] == 1


def test_reference_is_torch_adamw_in_fp32():
    """With fp32 state the reference is torch.optim.AdamW's single-tensor step, bit for bit."""
    param, grad, exp_avg, exp_avg_sq = _state(300, torch.float32, torch.float32, torch.float32)
    torch_param = torch.nn.Parameter(param.clone())
    optimizer = torch.optim.AdamW(
        [torch_param], lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps,
        weight_decay=HYPER.weight_decay, foreach=False,
    )  # fmt: skip
    optimizer.state[torch_param] = {
        "step": torch.tensor(float(HYPER.step - 1)),
        "exp_avg": exp_avg.clone(),
        "exp_avg_sq": exp_avg_sq.clone(),
    }
    torch_param.grad = grad.clone()
    optimizer.step()
    adamw_step_reference_(param, grad, exp_avg, exp_avg_sq, HYPER)
    assert torch.equal(param, torch_param.detach())
    assert torch.equal(exp_avg, optimizer.state[torch_param]["exp_avg"])


def test_reference_works_in_chunks(monkeypatch):
    """A weight larger than the reference's chunk updates as if in one piece."""
    whole = _state(1000, torch.bfloat16, torch.bfloat16, torch.bfloat16)
    chunked = [tensor.clone() for tensor in whole]
    adamw_step_reference_(*whole, HYPER)
    monkeypatch.setattr(module, "STEP_CHUNK", 96)
    adamw_step_reference_(*chunked, HYPER)
    for one, two in zip(whole, chunked):
        assert torch.equal(one, two)


@gpu
@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.float32, torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    ],
)
def test_kernel_matches_reference_on_the_gpu(dtypes, launches):
    _compare(64 * 768 * 3072 // 16 + 77, dtypes, "cuda")
    assert launches["n"] == 1
