"""accumulate_ (fp32 total += one or two bf16/fp16 addends, in place) and sum_in_fp32: the Triton
kernel (interpreter on CPU, real on GPU) against torch's adds in the same order, which it must
match bit for bit."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron.kernels import accumulate as module  # noqa: E402
from megatron.kernels.accumulate import (  # noqa: E402
    accumulate_,
    accumulate_reference_,
    sum_in_fp32,
)
from tests.markers import gpu  # noqa: E402

interpreted = pytest.mark.usefixtures("triton_kernels")


@pytest.fixture
def launches(monkeypatch):
    """Counts kernel launches, proving the kernel (not the reference) ran."""
    count = {"n": 0}
    original = module._accumulate_kernel.run

    def run(*args, **kwargs):
        count["n"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module._accumulate_kernel, "run", run)
    return count


def _pair(shape, dtype, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    total = torch.randn(shape, generator=generator).to(device)
    addend = torch.randn(shape, generator=generator).to(device, dtype)
    return total, addend


@interpreted
@pytest.mark.parametrize("shape", [(1,), (3, 5), (module.BLOCK + 7,), (2, 3, module.BLOCK // 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_torch_add_bit_for_bit(launches, shape, dtype):
    total, addend = _pair(shape, dtype)
    expected = total.clone().add_(addend)
    result = accumulate_(total, addend)
    assert result is total  # in place
    assert torch.equal(total, expected)
    assert launches["n"] == 1


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_two_addends_match_two_torch_adds_bit_for_bit(launches, dtype):
    total, first = _pair((3, module.BLOCK + 5), dtype, seed=1)
    second = torch.randn(first.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    expected = total.clone().add_(first).add_(second)  # autograd's order, micro-batch by batch
    accumulate_(total, first, second)
    assert torch.equal(total, expected)
    fresh = sum_in_fp32(first, second)
    assert fresh.dtype == torch.float32
    assert torch.equal(fresh, first.float().add_(second))
    assert torch.equal(sum_in_fp32(first), first.float())
    assert launches["n"] == 3


@interpreted
def test_other_layouts_go_to_torch(launches):
    total, addend = _pair((6, 4), torch.bfloat16)
    expected = total.clone().add_(addend.t().contiguous().t())
    accumulate_(total, addend.t().contiguous().t())  # strided addend: torch's add
    assert torch.equal(total, expected)
    half = torch.zeros(3, dtype=torch.float16)  # not an fp32 total
    accumulate_(half, torch.ones(3, dtype=torch.float16))
    assert torch.equal(half, torch.ones(3, dtype=torch.float16))
    assert launches["n"] == 0


@interpreted
@pytest.mark.parametrize("second", [False, True])
def test_bf16_total_is_summed_in_fp32_and_rounded_once(launches, second):
    """A bf16 main gradient: (total + first) + second in fp32, one rounding to bf16, as the
    reference computes it; closer to the exact sum than two bf16 adds."""
    generator = torch.Generator().manual_seed(3)
    total, first, other = (
        torch.randn(module.BLOCK + 9, generator=generator).bfloat16() for _ in range(3)
    )
    addend = other if second else None
    expected = total.float().add_(first)
    if second:
        expected.add_(other)
    expected = expected.bfloat16()
    reference = accumulate_reference_(total.clone(), first, addend)
    accumulate_(total, first, addend)
    assert torch.equal(total, expected) and torch.equal(reference, expected)
    assert launches["n"] == 1


def test_reference_is_torch_add():
    total, addend = _pair((5,), torch.bfloat16)
    expected = total.clone() + addend.float()
    assert torch.equal(accumulate_reference_(total, addend), expected)


@gpu
def test_gpu_expert_gradient_shape_matches_torch_add():
    """A dMoE 125M expert weight gradient: 64 x 768 x 3072 (151M elements), two addends."""
    total, addend = _pair((64, 768, 3072), torch.bfloat16, device="cuda")
    second = torch.randn_like(addend)
    expected = total.clone().add_(addend).add_(second)
    accumulate_(total, addend, second)
    assert torch.equal(total, expected)
    assert torch.equal(sum_in_fp32(addend, second), addend.float().add_(second))
