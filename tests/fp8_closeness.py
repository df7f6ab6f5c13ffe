"""How far FP8 moves a model from its bf16 twin, measured where FP8 acts: each FP8 layer's
output and gradients against the bf16 layer's on the same operands, and each parameter's
gradient against the bf16 model's. The FP8 tests of the projections
(tests/parallelize/test_fp8_projections.py) and of the dMoE's experts
(tests/moe/test_fp8_experts.py) share it.

A loss near ln 64 says nothing here: on the tiny models FP8 moves it by about 1e-4, and so
would a dead expert or an attention output left at zero (about 1e-3). A layer's own
products do: FP8's few mantissa bits move each by 3-6% of its norm (relative Frobenius
error, as tests/moe/kernels/test_fp8_grouped_gemm.py bounds the kernel's), a layer left in
bf16 by nothing, a wrong scale or a dead expert by tens of percent.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from megatron.parallelize.fp8_projections import PROJECTION_NAMES
from moe.experts import Experts
from tests.tiny_gpt import bf16_autocast_loss

# A layer's relative error against its bf16 twin on the same operands: a bf16 layer gives 0,
# FP8 3.3-3.7% in a projection's output (two e4m3 operands), 5% in the experts' (two products
# in a row) and 4.5-6.2% in the gradients (a projection's output gradient is e5m2, 2 mantissa
# bits, under the "hybrid" format); a wrong scale or a dead expert gives 10-60%.
FP8_ROUNDING = (1e-3, 0.1)
# A parameter's gradient in the whole model against the bf16 model's: FP8's rounding in every
# layer adds up to 0.1-11% on the tiny models; a dead expert's share of a weight gradient is
# half its norm, a missing gradient all of it. Only an upper bound: a gradient no FP8 product
# computes still inherits the rounding of the activations FP8 changed.
GRADIENT_DRIFT = 0.25


def fp8_layers(model: nn.Module) -> Dict[str, str]:
    """{qualified name: the method to replay} of every layer of `model` that `--fp8-format`
    turns FP8 (megatron.parallelize.fp8_projections and moe.fp8_experts): the attention and MLP
    projections, and the dMoE's grouped experts. Read off the bf16 model, so that a layer the
    FP8 model left in bf16 is still expected."""
    layers = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in PROJECTION_NAMES:
            layers[name] = "forward"
        elif isinstance(module, Experts):
            layers[name] = "forward_grouped"
    return layers


@dataclass
class Call:
    """One call of a layer: its arguments and output as the model gave them, and the gradient
    that reached the output in the backward."""

    args: Tuple
    output: torch.Tensor
    grad_output: Optional[torch.Tensor] = None


def _copied(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


@contextlib.contextmanager
def recorded_calls(model: nn.Module, layers: Dict[str, str]) -> Iterator[Dict[str, Call]]:
    """{layer name: its Call} for the forward and backward run inside the block, each of
    `layers` ({name: method}) called once."""
    calls: Dict[str, Call] = {}
    wrapped = []

    def recorder(name: str, method):
        def call(*args):
            assert name not in calls, f"{name} was called twice"
            output = method(*args)
            calls[name] = record = Call(tuple(_copied(arg) for arg in args), output.detach())
            output.register_hook(lambda grad: setattr(record, "grad_output", grad.detach()))
            return output

        return call

    for name, method in layers.items():
        module = model.get_submodule(name)
        setattr(module, method, recorder(name, getattr(module, method)))
        wrapped.append((module, method))
    try:
        yield calls
    finally:
        for module, method in wrapped:
            delattr(module, method)  # the class's method again


def _replay(module: nn.Module, method: str, call: Call) -> Dict[str, torch.Tensor]:
    """{"output", "input k gradient", "<parameter> gradient"}: `module.method` on the
    recorded arguments under bf16 autocast, and its backward from the recorded output
    gradient."""
    args = [
        arg.clone().requires_grad_() if isinstance(arg, torch.Tensor) and arg.is_floating_point()
        else arg
        for arg in call.args
    ]  # fmt: skip
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = getattr(module, method)(*args)
    leaves = {f"input {k}": arg for k, arg in enumerate(args) if getattr(arg, "requires_grad", 0)}
    # The biases are added after the product, in the compute dtype: FP8 leaves them alone.
    leaves.update({n: p for n, p in module.named_parameters() if not n.endswith("bias")})
    grads = torch.autograd.grad(output, list(leaves.values()), call.grad_output, allow_unused=True)
    results = {"output": output.detach()}
    results.update({f"{name} gradient": g for name, g in zip(leaves, grads) if g is not None})
    return results


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """|actual - expected| / |expected| in Frobenius norms, in fp32."""
    expected = expected.float()
    return ((actual.float() - expected).norm() / expected.norm()).item()


def layer_errors(bf16_model: nn.Module, fp8_model: nn.Module) -> Dict[str, Dict[str, float]]:
    """{FP8 layer: {output or gradient: relative error}}: the forward and backward of
    `bf16_autocast_loss(fp8_model)` give each FP8 layer (fp8_layers of `bf16_model`) its
    operands and output gradient; the FP8 layer and its bf16 twin then compute the output, the
    input gradients and the weight gradients from those same operands. Checks that the replay
    repeats the model's own output bit for bit, so that what is compared is what the model
    computed."""
    layers = fp8_layers(bf16_model)
    with recorded_calls(fp8_model, layers) as calls:
        bf16_autocast_loss(fp8_model).backward()
    assert sorted(calls) == sorted(layers), "a layer was not called"
    errors = {}
    for name, method in layers.items():
        call = calls[name]
        fp8 = _replay(fp8_model.get_submodule(name), method, call)
        assert torch.equal(fp8["output"], call.output), f"{name}: the replay differs"
        bf16 = _replay(bf16_model.get_submodule(name), method, call)
        assert sorted(fp8) == sorted(bf16), name
        errors[name] = {what: relative_error(fp8[what], bf16[what]) for what in bf16}
    return errors


def outside(errors: Dict[str, Dict[str, float]], bounds: Tuple[float, float]) -> List[str]:
    """The `errors` outside (low, high), as `layer: what error` lines."""
    low, high = bounds
    return [
        f"{layer}: {what} {error:.2e}"
        for layer, by_what in errors.items()
        for what, error in by_what.items()
        if not low < error < high
    ]


def gradient_errors(reference: nn.Module, model: nn.Module) -> Dict[str, float]:
    """{parameter: relative error of its gradient in `model` against `reference`'s}, after a
    backward of each."""
    expected = dict(reference.named_parameters())
    return {
        name: relative_error(param.grad, expected[name].grad)
        for name, param in model.named_parameters()
    }


def assert_fp8_follows_bf16(
    bf16_model: nn.Module,
    fp8_model: nn.Module,
    reduce_gradients: Callable[[nn.Module], None] = lambda model: None,
) -> Dict[str, Dict[str, float]]:
    """The two models (the same weights) each take a forward and backward of
    `bf16_autocast_loss`; every FP8 layer's output and gradients are within FP8_ROUNDING of
    its bf16 twin's on the same operands (`layer_errors`), and every parameter's gradient,
    after `reduce_gradients` of each model, within GRADIENT_DRIFT of the bf16 model's. Returns
    the layer errors."""
    bf16_autocast_loss(bf16_model).backward()
    errors = layer_errors(bf16_model, fp8_model)
    wrong = outside(errors, FP8_ROUNDING)
    assert not wrong, f"not within {FP8_ROUNDING} of bf16: {wrong}"
    for model in (bf16_model, fp8_model):
        reduce_gradients(model)
    drift = {name: e for name, e in gradient_errors(bf16_model, fp8_model).items() if e > 0}
    assert len(drift) == len(list(fp8_model.parameters())), "a gradient FP8 did not change"
    far = {name: round(e, 4) for name, e in drift.items() if not e < GRADIENT_DRIFT}
    assert not far, f"gradients further than {GRADIENT_DRIFT} from bf16's: {far}"
    return errors
