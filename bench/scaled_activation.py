"""The expert activation scaled by the router's weights, forward + backward, at the dMoE layer's
shapes: moe.kernels.scaled_activation's Triton op against the same function compiled by Inductor
(what the compiled layer ran before the op) and ATen's plain GELU (no scaling: the dense layer's,
over the same bytes), in one run.

    python -m bench.scaled_activation [--sweep]

Rows and width per configuration of bench/moe_layer.py: tokens * top_k rows of ffn channels.
Bytes per step: the forward reads h and writes the output, the backward reads the gradient and
h and writes h's gradient: 5 x rows x width x 2 bytes. Steps are timed as CUDA graph replays,
so that the op's autograd, which costs more host time than Inductor's, does not count. `--sweep`
also times each kernel alone at other tile shapes.
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F

from bench.moe_layer import CONFIGS
from bench.timing import capture_graph, median_ms
from moe.kernels import scaled_activation as sa

SWEEP = [(4, 256), (8, 256), (2, 256), (4, 128), (2, 512), (1, 1024)]
FORWARD_SWEEP = [(16, 256), (8, 256), (4, 512), (8, 512), (2, 1024), (4, 1024), (1, 2048)]


def _eager(h, scale):
    """The compiled layer's code before the op (Experts._mlp)."""
    value = F.gelu(h, approximate="tanh")
    return (value.float() * scale.float().unsqueeze(-1)).to(h.dtype)


def _step(fn, inputs, grad):
    """fn(*inputs) forward + backward on fresh leaves (gradients set to None before each step,
    so the backward writes them instead of adding), warmed up and captured as a CUDA graph;
    returns its replay."""
    # Fresh leaves: autograd nodes of the earlier steps' tensors were made on another stream,
    # which a capture cannot depend on.
    leaves = [tensor.detach().requires_grad_(True) for tensor in inputs]

    def step():
        for leaf in leaves:
            leaf.grad = None
        fn(*leaves).backward(grad)

    return capture_graph(step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="backward tile shapes")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, median of 20")
    print("| rows x width | ATen GELU, no scale ms | Inductor ms | Triton op ms | Triton op TB/s "
          "| max abs diff (out, grad h, grad scale) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---|")
    compiled = torch.compile(_eager, dynamic=False)
    op = functools.partial(sa.scaled_activation, activation="gelu")
    for _, ffn, _, top_k, tokens in CONFIGS:
        rows = tokens * top_k
        h = torch.randn(rows, ffn, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        scale = torch.rand(rows, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(rows, ffn, device="cuda", dtype=torch.bfloat16)
        results = {}
        for name, fn in (("inductor", compiled), ("op", op)):
            h.grad = scale.grad = None
            out = fn(h, scale)
            out.backward(grad)
            results[name] = (out.detach(), h.grad, scale.grad)
        diffs = ", ".join(
            f"{(a.float() - b.float()).abs().max().item():.1e}"
            for a, b in zip(results["op"], results["inductor"])
        )
        plain = _step(lambda h, scale: F.gelu(h, approximate="tanh"), [h, scale], grad)
        times = [median_ms(_step(fn, [h, scale], grad)) for fn in (compiled, op)]
        plain_ms = median_ms(plain)
        rate = 5 * rows * ffn * 2 / times[1] / 1e9
        print(f"| {rows} x {ffn} | {plain_ms:.3f} | {times[0]:.3f} | {times[1]:.3f} | {rate:.2f} "
              f"| {diffs} |", flush=True)  # fmt: skip
        if args.sweep:
            h_data = h.detach()
            for block_rows, block_w in SWEEP:
                backward = functools.partial(
                    sa._scaled_activation_backward_triton, grad, h_data, scale.detach(), "gelu",
                    block_rows=block_rows, block_w=block_w,
                )  # fmt: skip
                print(f"  backward, {block_rows} rows x {block_w}: {median_ms(backward):.3f} ms")
            for block_rows, block_w in FORWARD_SWEEP:
                forward = functools.partial(
                    sa._scaled_activation_triton, h_data, scale.detach(), "gelu",
                    block_rows=block_rows, block_w=block_w,
                )  # fmt: skip
                print(f"  forward, {block_rows} rows x {block_w}: {median_ms(forward):.3f} ms")


if __name__ == "__main__":
    main()
