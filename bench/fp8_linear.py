"""One linear layer's three products (forward, input gradient, weight gradient) in bf16 against
FP8 (megatron.kernels.fp8_linear), at the projections of the models FP8 is meant for: where the
FP8 tensor cores' 2x over bf16 survives the quantization around each product.

    python -m bench.fp8_linear [--no-compile] [--repeats 20]
    python -m bench.fp8_linear --device cpu --tiny      # a smoke test of the bench itself

Each row times y = x w^T and its backward for one weight [out, in] at `tokens` rows: bf16
`F.linear` under autocast (the master weight fp32, as in training) against `fp8_linear` with
each recipe. Compiled by default (torch.compile fuses the amax, scale and cast around each
product; eager runs them as separate kernels). ms is the median wall time of --repeats steps
(bench.timing.median_ms, after 3 warm-up steps); TFLOP/s counts the three products'
6 * tokens * in * out.
"""

from __future__ import annotations

import argparse
import functools
from typing import List, Tuple

import torch
import torch.nn.functional as F

from bench.timing import median_ms
from megatron.kernels.fp8_linear import FP8_RECIPES, Fp8Recipe, fp8_linear

# (name, tokens, in, out): GPT-2 1.3B (examples/gpt2_1315m_1gpu.sh: hidden 2048, micro batch
# 8 x 1024 tokens) and a Mixtral-shaped dMoE's dense equivalents (hidden 4096, ffn 14336,
# SwiGLU fc1 of 2 x 14336 rows), at 8,192 tokens.
SHAPES: List[Tuple[str, int, int, int]] = [
    ("gpt2-1.3B qkv", 8192, 2048, 6144),
    ("gpt2-1.3B proj", 8192, 2048, 2048),
    ("gpt2-1.3B fc1", 8192, 2048, 8192),
    ("gpt2-1.3B fc2", 8192, 8192, 2048),
    ("mixtral qkv (GQA 8)", 8192, 4096, 6144),
    ("mixtral fc1 (SwiGLU)", 8192, 4096, 28672),
    ("mixtral fc2", 8192, 14336, 4096),
]
TINY = [("tiny", 64, 32, 48)]


def _bf16_step(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor) -> None:
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        y = F.linear(x, weight)
    y.backward(grad)


def _fp8_step(recipe: Fp8Recipe):
    def step(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor) -> None:
        fp8_linear(x, weight, recipe).backward(grad)

    return step


def _torchao_steps() -> dict:
    """torchao's float8 training (the peer: torchtitan's FP8) on an nn.Linear sharing the
    weight, one step builder per recipe, where torchao is importable; else none."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return {}

    def builder(recipe: str):
        def build(weight: torch.Tensor):
            layer = torch.nn.Sequential(torch.nn.Linear(1, 1, bias=False, device="meta"))
            layer[0].in_features, layer[0].out_features = weight.shape[1], weight.shape[0]
            layer[0].weight = torch.nn.Parameter(weight.detach(), requires_grad=True)
            config = Float8LinearConfig.from_recipe_name(recipe)
            convert_to_float8_training(layer, config=config)

            def step(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor) -> None:
                with torch.autocast(x.device.type, dtype=torch.bfloat16):
                    y = layer(x)
                y.backward(grad)

            return step

        return build

    return {f"torchao {recipe}": builder(recipe) for recipe in FP8_RECIPES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="one tiny shape (smoke test)")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    # name -> a builder of the step for one weight
    steps = {"bf16": lambda weight: _bf16_step}
    for scaling in FP8_RECIPES:
        step = _fp8_step(Fp8Recipe(scaling))
        steps[f"fp8 {scaling}"] = lambda weight, step=step: step
    if device.type == "cuda":
        steps.update(_torchao_steps())
    print(
        f"{torch.__version__}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}"
    )
    header = "| projection | tokens x in x out | " + " | ".join(
        f"{name} ms (TFLOP/s)" for name in steps
    )
    print(header + " | best fp8 / bf16 |")
    print("|---|---|" + "---:|" * (len(steps) + 1))
    for name, tokens, fan_in, fan_out in TINY if args.tiny else SHAPES:
        generator = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(tokens, fan_in, generator=generator).to(device, torch.bfloat16)
        weight = torch.randn(fan_out, fan_in, generator=generator).to(device).mul_(0.02)
        grad = torch.randn(tokens, fan_out, generator=generator).to(device, torch.bfloat16)
        x.requires_grad_(True)
        weight.requires_grad_(True)
        flops = 6 * tokens * fan_in * fan_out
        times = {}
        for step_name, build in steps.items():
            # A fresh compile per shape and step: each is timed on its own graph.
            torch._dynamo.reset()
            step = build(weight)
            timed = torch.compile(step, dynamic=False) if args.compile else step
            times[step_name] = median_ms(
                functools.partial(timed, x, weight, grad),
                warmup=3,
                repeats=args.repeats,
                wall_clock=True,
            )
        cells = [f"{ms:.3f} ({flops / ms / 1e9:.0f})" for ms in times.values()]
        best_fp8 = min(ms for step_name, ms in times.items() if step_name.startswith("fp8 "))
        speedup = times["bf16"] / best_fp8
        print(
            f"| {name} | {tokens} x {fan_in} x {fan_out} | "
            + " | ".join(cells)
            + f" | {speedup:.2f}x |"
        )


if __name__ == "__main__":
    main()
