"""Forward + backward of one dMoE layer in bf16 on one GPU, per backend, next to a dense MLP of
the same FLOPs (hidden -> top_k * ffn -> hidden through cuBLAS), timed in the same run.

    python -m bench.moe_layer [--backends grouped sparse grouped+compile+fp8] [--check]
        [--cuda-graphs] [--profile]

TFLOP/s counts 3 x 2 x tokens x top_k x 2 x hidden x ffn (the expert matmuls, forward and
backward). `--check` first compares each backend with the loop-over-experts reference at a real
shape on the GPU (outputs and gradients, relative error against an fp32 run). `--cuda-graphs`
also times each step captured as a CUDA graph: one replay at a time, and 10 replays back to back
as a training loop runs them. Every timing follows a second of steps back to back, so that each
layer is timed at the clock the GPU holds under steady work (see heat_gpu). `--profile` prints
the top GPU kernels of --profile-configs instead (launched, and with --cuda-graphs also replayed).
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
import torch.nn.functional as F
from torch import nn

from bench.timing import mean_step_ms, median_step_ms
from megatron.config import ModelConfig
from megatron.kernels.dispatch import kernel_mode
from megatron.kernels.fp8_linear import Fp8Recipe
from moe.config import MoEConfig
from moe.fp8_experts import dropless_fp8
from moe.kernels.grouped_gemm import choose_backend
from moe.layers import build_moe_layer

# (hidden, ffn per expert, experts, top_k, tokens): the configurations.
CONFIGS = [
    (768, 3072, 64, 1, 16384),
    (1024, 4096, 64, 1, 16384),
    (2048, 1024, 64, 8, 16384),
    (4096, 14336, 8, 2, 8192),
]


DENSE = "dense same-FLOPs"
COMPILED_SUFFIX = "+compile"
# torch.compile with CUDA graphs (mode="reduce-overhead"): shows what host launch time costs.
GRAPHED_SUFFIX = "+compile-cudagraphs"
# The experts' grouped GEMMs in FP8 (torch._scaled_grouped_mm), by recipe.
FP8_SUFFIXES = {"+fp8": "rowwise", "+fp8-tensorwise": "tensorwise"}


def build_layer(hidden, ffn, experts, top_k, backend, dtype=torch.bfloat16):
    """The layer for `backend`, on the grouped GEMM a run would choose for this GPU and dtype;
    "grouped+compile" is the grouped layer under torch.compile, as training runs it (one graph
    on torch._grouped_mm); a "+fp8" or "+fp8-tensorwise" ending gives its expert products FP8
    (moe.fp8_experts, rowwise by default), the weights quantized once as a training step does."""
    fp8 = None
    for suffix, scaling in FP8_SUFFIXES.items():
        if backend.endswith(suffix):
            fp8, backend = Fp8Recipe(scaling), backend.removesuffix(suffix)
    graphed = backend.endswith(GRAPHED_SUFFIX)
    backend = backend.removesuffix(GRAPHED_SUFFIX)
    compiled = backend.endswith(COMPILED_SUFFIX)
    backend = backend.removesuffix(COMPILED_SUFFIX)
    model = ModelConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=max(1, hidden // 64),
        ffn_hidden_size=ffn, seq_length=1024, max_position_embeddings=1024,
        add_bias_linear=False, init_method_std=0.02,
    )  # fmt: skip
    grouped_gemm = choose_backend(
        torch.device("cuda"), dtype, (hidden, ffn), experts, kernel_mode()
    )
    moe = MoEConfig(num_experts=experts, top_k=top_k, mlp_impl=backend, grouped_gemm=grouped_gemm)
    torch.manual_seed(0)
    layer = build_moe_layer(model, moe).cuda().to(dtype)
    if fp8 is not None:
        reason = dropless_fp8(layer, fp8)
        if reason is not None:
            raise ValueError(f"no FP8 experts here: {reason}")
        layer.experts.refresh_compute_weights(dtype, accumulate_in_place=False)
    # One shape per layer, as in training; dynamic=False keeps the later configs from being
    # compiled for symbolic shapes after the first.
    if graphed:
        return torch.compile(layer, dynamic=False, mode="reduce-overhead")
    return torch.compile(layer, dynamic=False) if compiled else layer


class DenseSameFlops(nn.Module):
    def __init__(self, hidden, width):
        super().__init__()
        self.fc1 = nn.Linear(hidden, width, bias=False)
        self.fc2 = nn.Linear(width, hidden, bias=False)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


def drop_kept_losses(module):
    """Drop the losses a MoE layer keeps for the model to collect: they hold the step's autograd
    graph alive, and with it the AccumulateGrad nodes of the input and the weights. A node made
    on the default stream and reused in a graph capture on a side stream makes the capture fail
    ("operation would make the legacy stream depend on a capturing blocking stream")."""
    for layer in module.modules():
        if getattr(layer, "auxiliary_losses", None) is not None:
            layer.auxiliary_losses = None


def time_fwd_bwd(module, x, grad, warmup=3, repeats=10, graphed=False):
    """(Median ms of one forward + backward timed alone, the peak memory of one step in GiB,
    ms per step of steps run back to back).

    Gradients are set to None before each step, as a training loop's zero_grad does, so the
    backward writes them rather than adding into last step's (for the dMoE that add would be a
    pass over 64 expert weights the dense layer does not have). `graphed` captures one step in a
    CUDA graph and times its replays: the GPU's time for the step without the host's launch
    time, which a whole model under torch.compile hides behind the GPU's work. Both timings
    follow `heat_gpu`, so that every layer is timed at the clock a training run holds.
    """
    run = prepare_step(module, x, grad, warmup, graphed)
    heat_gpu(run)
    alone_ms = median_step_ms(run, steps=1, rounds=repeats)
    peak = torch.cuda.max_memory_allocated() / 2**30
    heat_gpu(run)
    return alone_ms, peak, median_step_ms(run, steps=10, rounds=5)


def heat_gpu(run, seconds=1.0):
    """Run steps back to back for about `seconds`. Within a second of steady work at these sizes
    the GPU reaches its power limit and lowers its SM clock, so that each step takes longer
    (bench/replay_clocks.py; docs/benchmark-log.md). Timing a layer cold and the next one hot
    compared them at different clocks."""
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(5):
            run()
        torch.cuda.synchronize()


def prepare_step(module, x, grad, warmup=3, graphed=False):
    """One training step of `module` (gradients set to None first), warmed up; with `graphed`
    a CUDA graph's replay of it. Resets the peak memory statistics after the warm-up."""

    def step():
        module.zero_grad(set_to_none=True)
        x.grad = None
        module(x).backward(grad)
        drop_kept_losses(module)

    # A graph is captured on a side stream; the warm-up runs there too, as torch's CUDA graph
    # notes advise.
    stream = torch.cuda.Stream() if graphed else torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    if not graphed:
        return step
    graph = torch.cuda.CUDAGraph()
    module.zero_grad(set_to_none=True)
    x.grad = None
    with torch.cuda.graph(graph, stream=stream):
        module(x).backward(grad)
    return graph.replay


def profile_steps(module, x, grad, graphed, steps=5):
    """(GPU operations per step, ms of GPU time per step, ms per step start to end, the
    profiler) over `steps` steps, launched or replayed as a CUDA graph."""
    run = prepare_step(module, x, grad, graphed=graphed)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        step_ms = mean_step_ms(run, steps)
    cuda = torch.autograd.DeviceType.CUDA
    kernels = [event for event in profile.events() if event.device_type == cuda]
    busy_ms = sum(event.time_range.elapsed_us() for event in kernels) / 1e3 / steps
    return len(kernels) / steps, busy_ms, step_ms, profile


def check(backend):
    """Backend vs the loop reference at a real shape; returns the worst relative error."""
    hidden, ffn, experts, top_k, tokens = 1024, 2048, 16, 2, 4096
    errors = []
    results = {}
    # The compiled layer runs torch._grouped_mm, bf16 only, and the FP8 one quantizes: both are
    # checked against the eager grouped layer in bf16; the others against the loop reference in
    # fp32.
    plain = backend
    for suffix in FP8_SUFFIXES:
        plain = plain.removesuffix(suffix)
    eager = plain.removesuffix(GRAPHED_SUFFIX).removesuffix(COMPILED_SUFFIX)
    in_bf16 = eager != backend
    baseline = eager if in_bf16 else "reference"
    dtype = torch.bfloat16 if in_bf16 else torch.float32
    for name in (baseline, backend):
        layer = build_layer(hidden, ffn, experts, top_k, name, dtype=dtype)
        torch.manual_seed(1)
        x = torch.randn(1, tokens, hidden, device="cuda", dtype=dtype, requires_grad=True)
        out = layer(x)
        out.float().square().mean().backward()
        results[name] = [
            out.detach(),
            x.grad,
            layer.experts.w1.grad,
            layer.router.layer.weight.grad,
        ]
    for got, want in zip(results[backend], results[baseline]):
        got, want = got.float(), want.float()
        errors.append(((got - want).norm() / want.norm()).item())
    return max(errors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--backends", nargs="+",
        default=["grouped", "grouped+compile", "grouped+compile+fp8", "sparse"],
        help="grouped, sparse, reference, or any of them with +compile or +compile-cudagraphs; "
        "grouped ones also with +fp8 (rowwise) or +fp8-tensorwise at the end; "
        f"--profile also takes '{DENSE}'",
    )  # fmt: skip
    parser.add_argument("--check", action="store_true")
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="also time (or with --profile, profile) each step replayed as a CUDA graph",
    )
    parser.add_argument(
        "--profile", action="store_true", help="top CUDA kernels of --profile-configs"
    )
    parser.add_argument(
        "--profile-configs", type=int, nargs="+", default=[0], help="indices into CONFIGS"
    )
    args = parser.parse_args()
    for index in args.profile_configs if args.profile else []:
        hidden, ffn, experts, top_k, tokens = CONFIGS[index]
        x = torch.randn(1, tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn_like(x)
        for backend in args.backends:
            if backend == DENSE:
                layer = DenseSameFlops(hidden, top_k * ffn).cuda().to(torch.bfloat16)
            else:
                layer = build_layer(hidden, ffn, experts, top_k, backend)
            for graphed in [False, True] if args.cuda_graphs else [False]:
                operations, busy_ms, wall_ms, profile = profile_steps(layer, x, grad, graphed)
                how = "replayed as a CUDA graph" if graphed else "launched"
                print(f"== {backend}, config {CONFIGS[index]}, 5 steps {how}: {operations:.0f} "
                      f"GPU operations, {busy_ms:.3f} ms of GPU time and {wall_ms:.3f} ms from "
                      "start to end per step")  # fmt: skip
                print(
                    profile.key_averages().table(
                        sort_by="cuda_time_total", row_limit=40, max_name_column_width=150
                    )
                )
            del layer
    if args.profile:
        return
    if args.check:
        for backend in args.backends:
            print(f"check {backend} (4096 tokens, 16 experts, top-2; compiled: bf16 vs eager, "
                  f"else fp32 vs reference): max relative error {check(backend):.2e}",
                  flush=True)  # fmt: skip
    rows = []
    for hidden, ffn, experts, top_k, tokens in CONFIGS:
        flops = 3 * 2 * tokens * top_k * 2 * hidden * ffn
        torch.manual_seed(0)
        x = torch.randn(1, tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn_like(x)
        row = [(hidden, ffn, experts, top_k, tokens)]
        for name in [DENSE, *args.backends]:
            # Peaks count this layer's weights, inputs and step only: whatever earlier
            # measurements left allocated (compiled code's caches, say) is subtracted.
            x.grad = None
            gc.collect()
            torch.cuda.empty_cache()
            leftover = torch.cuda.memory_allocated() - 2 * x.numel() * x.element_size()
            if leftover > 2**26:
                print(f"{name}: {leftover / 2**30:.2f} GiB still allocated before it, subtracted")
            if name == DENSE:
                module = DenseSameFlops(hidden, top_k * ffn).cuda().to(torch.bfloat16)
            else:
                module = build_layer(hidden, ffn, experts, top_k, name)
            times = []
            for graphed in [False, True] if args.cuda_graphs else [False]:
                try:
                    ms, peak, steady_ms = time_fwd_bwd(module, x, grad, graphed=graphed)
                    times.append((ms, peak - leftover / 2**30))
                    if graphed:
                        times.append((steady_ms, float("nan")))
                except Exception as error:  # report, keep measuring the others
                    print(f"{name} failed on {row[0]}: {error!r}"[:400], flush=True)
                    # A failed run keeps its columns: an infinite peak prints, a NaN one not.
                    times += [(float("nan"), float("inf"))] + [
                        (float("nan"), float("nan"))
                    ] * graphed
            del module
            row.append((name, times))
        rows.append(row)
        # Progress as each configuration completes; the table follows at the end.
        measured = ", ".join(
            f"{name} " + " / ".join(f"{ms:.2f} ms" for ms, _ in times) for name, times in row[1:]
        )
        print(f"{row[0]}: {measured}", flush=True)
    print(
        f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, forward + backward "
        "of one layer, gradients set to None before each step"
    )
    graph_columns = (
        " graph replay ms | TFLOP/s | peak GiB | x dense | 10 replays back to back, ms per step"
        " | TFLOP/s | x dense |"
        if args.cuda_graphs
        else ""
    )
    print(f"| hidden, ffn, experts, top-k, tokens | impl | ms | TFLOP/s | peak GiB | x dense |"
          f"{graph_columns}")  # fmt: skip
    print("|---|---|" + "---:|" * (11 if args.cuda_graphs else 4))
    for row in rows:
        config = row[0]
        flops = 3 * 2 * config[4] * config[3] * 2 * config[0] * config[1]
        dense_times = row[1][1]
        for name, times in row[1:]:
            cells = []
            for (ms, peak), (dense_ms, _) in zip(times, dense_times):
                peak_cell = [] if peak != peak else [f"{peak:.2f}"]  # NaN: no peak of its own
                cells += [
                    f"{ms:.2f}",
                    f"{flops / ms / 1e9:.0f}",
                    *peak_cell,
                    f"{ms / dense_ms:.2f}",
                ]
            print(f"| {config} | {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
