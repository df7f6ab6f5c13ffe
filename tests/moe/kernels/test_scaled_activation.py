"""moe.kernels.scaled_activation: the Triton kernels (Triton's CPU interpreter) against the
references, forward and backward, and the references against the eager code they replace."""

import pytest
import torch
import torch.nn.functional as F

from megatron.kernels.dispatch import TRITON_AVAILABLE
from moe.kernels import scaled_activation as sa


def _eager(h, scale, activation):
    """What Experts did before the op: the activation in h's dtype, the product in fp32."""
    value = F.gelu(h, approximate="tanh") if activation == "gelu" else F.silu(h)
    return (value.float() * scale.float().unsqueeze(-1)).to(h.dtype)


def _run(fn, h, scale, grad):
    h = h.detach().requires_grad_(True)
    scale = scale.detach().requires_grad_(True)
    out = fn(h, scale)
    out.backward(grad)
    return out, h.grad, scale.grad


@pytest.mark.parametrize("activation", sa.ACTIVATIONS)
def test_reference_op_is_the_eager_code(activation):
    generator = torch.Generator().manual_seed(0)
    h = torch.randn(12, 40, generator=generator).to(torch.bfloat16)
    scale = torch.rand(12, generator=generator)
    grad = torch.randn(12, 40, generator=generator).to(torch.bfloat16)
    got = _run(lambda h, s: sa.scaled_activation(h, s, activation), h, scale, grad)
    want = _run(lambda h, s: _eager(h, s, activation), h, scale, grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed")
@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.parametrize("activation", sa.ACTIVATIONS)
@pytest.mark.parametrize(
    "rows,width,dtype",
    # Rows and channels off the 16 x 256 (forward) and 8 x 256 (backward) tiles; a width over
    # two backward steps; bf16 rounding as the layer runs it.
    [(37, 300, torch.float32), (5, 600, torch.float32), (21, 70, torch.bfloat16)],
)
def test_kernels_match_the_references(activation, rows, width, dtype):
    generator = torch.Generator().manual_seed(rows + width)
    # Wide enough to reach both tails of the activations, where tanh and exp saturate.
    h = (4 * torch.randn(rows, width, generator=generator)).to(dtype)
    scale = torch.rand(rows, generator=generator)
    grad = torch.randn(rows, width, generator=generator).to(dtype)
    got = _run(lambda h, s: sa.scaled_activation(h, s, activation), h, scale, grad)
    want = _run(lambda h, s: sa.scaled_activation_reference(h, s, activation), h, scale, grad)
    if dtype == torch.float32:
        tolerances = {"rtol": 1e-5, "atol": 1e-5}
    else:  # a different tanh/exp in fp32 can round a value to the neighbouring bf16
        tolerances = {"rtol": 1.6e-2, "atol": 1e-2}
    for name, a, b in zip(("output", "grad h", "grad scale"), got, want):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, **tolerances, msg=name)


def test_bad_shapes_and_activations_are_refused():
    h = torch.randn(4, 8)
    with pytest.raises(ValueError, match="relu"):
        sa.scaled_activation(h, torch.ones(4), "relu")
    with pytest.raises(ValueError, match=r"\(4, 8\) and \(3,\)"):
        sa.scaled_activation(h, torch.ones(3), "gelu")


@pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed")
@pytest.mark.usefixtures("triton_kernels")
def test_kernels_leave_the_rows_past_valid_alone():
    """Expert-parallel padding: rows from `valid` on are neither written forward nor given a
    gradient; the rows before it are the reference's."""
    generator = torch.Generator().manual_seed(4)
    rows, width, valid = 37, 300, 21
    h = torch.randn(rows, width, generator=generator)
    scale = torch.rand(rows, generator=generator)
    grad = torch.randn(rows, width, generator=generator)
    count = torch.tensor([valid], dtype=torch.int32)
    out = torch.full((rows, width), float("nan"))
    sa._scaled_activation_triton(h, scale, "gelu", count, out=out)
    assert torch.isnan(out[valid:]).all()
    want = sa.scaled_activation_reference(h[:valid], scale[:valid], "gelu")
    torch.testing.assert_close(out[:valid], want, rtol=1e-5, atol=1e-5)
    got = _run(lambda h, s: sa.scaled_activation(h, s, "gelu", count), h, scale, grad)
    want = _run(lambda h, s: sa.scaled_activation_reference(h, s, "gelu"), h, scale, grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a[:valid], b[:valid], rtol=1e-5, atol=1e-5)
    outputs = (torch.full((rows, width), float("nan")), torch.full((rows,), float("nan")))
    sa._scaled_activation_backward_triton(grad, h, scale, "gelu", count, outputs=outputs)
    for written in outputs:
        assert torch.isnan(written[valid:]).all() and not torch.isnan(written[:valid]).any()
