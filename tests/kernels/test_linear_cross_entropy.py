"""The chunked output layer + cross-entropy against F.linear + cross_entropy: values, gradients,
autocast, what is saved for backward, and the Triton kernels through the interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.kernels import dispatch
from megatron.kernels.cross_entropy import cross_entropy
from megatron.kernels.linear_cross_entropy import default_chunk_rows, linear_cross_entropy

ROWS, HIDDEN, VOCAB = 13, 16, 37


def _inputs(dtype, rows=ROWS, hidden_size=HIDDEN, vocab=VOCAB, seed=0, weight_dtype=None):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, hidden_size, generator=generator).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=generator) * 0.5).to(weight_dtype or dtype)
    labels = torch.randint(0, vocab, (rows,), generator=generator)
    labels[[1, rows - 2]] = -100
    # Losses weighted by a random mask, then summed: a different grad_loss per row.
    kept = torch.rand(rows, generator=generator) > 0.3
    loss_weights = torch.rand(rows, generator=generator) * kept
    return hidden, weight, labels, loss_weights


def _unfused(hidden, weight, labels, **kwargs):
    return cross_entropy(F.linear(hidden, weight), labels, **kwargs)


def _run(op, hidden, weight, labels, loss_weights, grad_of=("hidden", "weight"), **kwargs):
    """(losses, grad_hidden, grad_weight) of sum(op(...) * loss_weights), None for no grad."""
    hidden = hidden.detach().clone().requires_grad_("hidden" in grad_of)
    weight = weight.detach().clone().requires_grad_("weight" in grad_of)
    losses = op(hidden, weight, labels, **kwargs)
    (losses * loss_weights).sum().backward()
    return losses.detach(), hidden.grad, weight.grad


def _assert_close(actual, expected, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    else:  # each side rounds logits and gradients to bf16 at its own points
        torch.testing.assert_close(actual, expected, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("chunk_rows", [1, 4, ROWS, 100, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_linear_then_cross_entropy(dtype, chunk_rows):
    """Chunks of one row, of a size not dividing N, of exactly N, of more than N, the default."""
    inputs = _inputs(dtype)
    fused = _run(linear_cross_entropy, *inputs, chunk_rows=chunk_rows)
    unfused = _run(_unfused, *inputs)
    for actual, expected in zip(fused, unfused):
        assert actual.dtype == expected.dtype
        _assert_close(actual, expected, dtype)
    losses, grad_hidden, _ = fused
    assert losses.dtype == torch.float32
    ignored = inputs[2] == -100
    assert losses[ignored].eq(0).all() and grad_hidden[ignored].eq(0).all()


@pytest.mark.parametrize("grad_of", [("hidden",), ("weight",)])
def test_only_the_needed_gradient(grad_of):
    inputs = _inputs(torch.float32)
    fused = _run(linear_cross_entropy, *inputs, grad_of=grad_of, chunk_rows=5)
    unfused = _run(_unfused, *inputs, grad_of=grad_of)
    for actual, expected in zip(fused, unfused):
        assert (actual is None) == (expected is None)
        if actual is not None:
            _assert_close(actual, expected, torch.float32)


def test_custom_ignore_index():
    hidden, weight, labels, loss_weights = _inputs(torch.float32)
    labels[labels == -100] = 3
    fused = _run(linear_cross_entropy, hidden, weight, labels, loss_weights, ignore_index=3)
    unfused = _run(_unfused, hidden, weight, labels, loss_weights, ignore_index=3)
    for actual, expected in zip(fused, unfused):
        _assert_close(actual, expected, torch.float32)
    assert fused[0][labels == 3].eq(0).all()


@pytest.mark.parametrize("hidden_dtype", [torch.float32, torch.bfloat16])
def test_autocast_with_an_fp32_weight(hidden_dtype):
    """bf16 autocast, the weight an fp32 parameter: as F.linear under the same autocast, and
    the weight's gradient fp32."""
    inputs = _inputs(hidden_dtype, weight_dtype=torch.float32)

    def under_autocast(op):
        def run(hidden, weight, labels, **kwargs):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return op(hidden, weight, labels, **kwargs)

        return run

    fused = _run(under_autocast(linear_cross_entropy), *inputs, chunk_rows=4)
    unfused = _run(under_autocast(_unfused), *inputs)
    assert fused[2].dtype == torch.float32 and fused[1].dtype == hidden_dtype
    for actual, expected in zip(fused, unfused):
        assert actual.dtype == expected.dtype
        _assert_close(actual, expected, torch.bfloat16)


def test_weight_of_another_dtype_is_cast_to_hidden():
    """No autocast: an fp32 weight with bf16 hidden runs in bf16 and gets an fp32 gradient."""
    hidden, weight, labels, loss_weights = _inputs(torch.bfloat16, weight_dtype=torch.float32)
    fused = _run(linear_cross_entropy, hidden, weight, labels, loss_weights, chunk_rows=3)
    unfused = _run(
        lambda h, w, y: _unfused(h, w.to(torch.bfloat16), y), hidden, weight, labels, loss_weights
    )
    assert fused[2].dtype == torch.float32
    for actual, expected in zip(fused, unfused):
        _assert_close(actual, expected, torch.bfloat16)


def _saved_shapes(op, hidden, weight, labels):
    shapes = []

    def pack(tensor):
        shapes.append(tuple(tensor.shape))
        return tensor

    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        losses = op(hidden, weight, labels)
    losses.sum().backward()
    return shapes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_are_not_saved_for_backward(dtype):
    hidden, weight, labels, _ = _inputs(dtype)
    logits_shape = (ROWS, VOCAB)
    assert logits_shape in _saved_shapes(_unfused, hidden, weight, labels)  # the test can see it
    fused = _saved_shapes(
        lambda h, w, y: linear_cross_entropy(h, w, y, chunk_rows=4), hidden, weight, labels
    )
    assert logits_shape not in fused and all(shape[-1:] != (VOCAB,) for shape in fused), fused


def test_default_chunk_is_about_256_mib_of_logits():
    assert default_chunk_rows(50304, torch.bfloat16) == 2**28 // (50304 * 2)
    assert default_chunk_rows(50304, torch.float32) == 2**28 // (50304 * 4)
    assert default_chunk_rows(2**30, torch.float32) == 1


def test_no_rows():
    hidden = torch.zeros(0, HIDDEN, requires_grad=True)
    weight = torch.randn(VOCAB, HIDDEN, requires_grad=True)
    losses = linear_cross_entropy(hidden, weight, torch.zeros(0, dtype=torch.long))
    losses.sum().backward()
    assert losses.shape == (0,) and hidden.grad.shape == (0, HIDDEN)
    assert weight.grad.eq(0).all()


def test_shapes_are_checked():
    with pytest.raises(ValueError, match=r"hidden \[N, h\] and weight \[V, h\].*\(5, 8\)"):
        linear_cross_entropy(torch.zeros(4, 6), torch.zeros(5, 8), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels \[N\]"):
        linear_cross_entropy(torch.zeros(4, 6), torch.zeros(5, 6), torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize("kernels", ["reference_kernels", "triton_kernels"])
def test_compiles_without_graph_break(kernels, request):
    """torch.compile(fullgraph=True) traces the autograd.Function, forward and backward, under
    autocast with an fp32 weight, and changes nothing; with the reference math and with the
    kernels' ops (opaque custom ops under the interpreter, see cross_entropy.py)."""
    request.getfixturevalue(kernels)
    hidden, weight, labels, loss_weights = _inputs(torch.float32, rows=9, vocab=300)

    def loss(hidden, weight):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = linear_cross_entropy(hidden, weight, labels, chunk_rows=4)
        return (losses * loss_weights).sum().reshape(1)

    explanation = torch._dynamo.explain(loss)(hidden, weight)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    results = [
        _run(lambda h, w, _, function=function: function(h, w), hidden, weight, labels, 1.0)
        for function in (compiled, loss)
    ]
    torch.testing.assert_close(results[0], results[1])
    assert results[0][2].dtype == torch.float32


@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_match_reference(dtype, launches, monkeypatch):
    """The kernels in the interpreter, one launch per chunk each way, against the reference."""
    inputs = _inputs(dtype, rows=9, vocab=300)
    fused = _run(linear_cross_entropy, *inputs, chunk_rows=4)
    assert launches == {"forward": 3, "backward": 3}
    monkeypatch.setattr(dispatch, "_mode", "reference")
    unfused = _run(_unfused, *inputs)
    for actual, expected in zip(fused, unfused):
        _assert_close(actual, expected, dtype)
