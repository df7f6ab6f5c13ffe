"""The six expert products of one dMoE layer step, each timed alone, next to the dense matmul of
the same FLOPs: where the grouped layer's GEMM time goes (bench/moe_layer.py times the layer).

    python bench/grouped_products.py [--configs 0 1 2 3] [--triton]

For expert weights w1 [E, h, f] and w2 [E, f, h] and N = tokens * top_k rows sorted by expert:
forward x @ w1, a @ w2; backward dy @ w2^T, a^T dy (weight gradient), dh @ w1^T, x^T dh. The
dense counterpart of each has the same M, N, K with one [K, N] weight (cuBLAS). Expert loads
follow a uniform random routing, as a freshly initialized router gives.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.moe_layer import CONFIGS  # noqa: E402


def median_ms(fn, warmup=5, repeats=20) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def products(hidden, ffn, experts, top_k, tokens, use_triton):
    rows = tokens * top_k
    device, dtype = "cuda", torch.bfloat16
    generator = torch.Generator(device="cpu").manual_seed(0)
    choice = torch.randint(0, experts, (rows,), generator=generator)
    counts = torch.bincount(choice, minlength=experts).to(device)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    x = torch.randn(rows, hidden, device=device, dtype=dtype)
    a = torch.randn(rows, ffn, device=device, dtype=dtype)
    w1 = torch.randn(experts, hidden, ffn, device=device, dtype=dtype)
    w2 = torch.randn(experts, ffn, hidden, device=device, dtype=dtype)
    d1 = torch.randn(hidden, ffn, device=device, dtype=dtype)
    d2 = torch.randn(ffn, hidden, device=device, dtype=dtype)
    grouped = {
        "fwd x@w1": lambda: torch._grouped_mm(x, w1, offs=offsets),
        "fwd a@w2": lambda: torch._grouped_mm(a, w2, offs=offsets),
        "dgrad dy@w2^T": lambda: torch._grouped_mm(x, w2.transpose(-2, -1), offs=offsets),
        "wgrad a^T dy": lambda: torch._grouped_mm(a.t(), x, offs=offsets),
        "dgrad dh@w1^T": lambda: torch._grouped_mm(a, w1.transpose(-2, -1), offs=offsets),
        "wgrad x^T dh": lambda: torch._grouped_mm(x.t(), a, offs=offsets),
    }
    dense = {
        "fwd x@w1": lambda: x @ d1,
        "fwd a@w2": lambda: a @ d2,
        "dgrad dy@w2^T": lambda: x @ d2.t(),
        "wgrad a^T dy": lambda: a.t() @ x,
        "dgrad dh@w1^T": lambda: a @ d1.t(),
        "wgrad x^T dh": lambda: x.t() @ a,
    }
    triton = {}
    if use_triton:
        from moe.kernels import grouped_gemm as gg

        tiles = gg.DEFAULT_TILE_SIZES
        triton = {
            "fwd x@w1": lambda: gg._grouped_mm_triton(
                x, w1, counts, transpose_weight=False, tile_sizes=tiles
            ),
            "dgrad dh@w1^T": lambda: gg._grouped_mm_triton(
                a, w1, counts, transpose_weight=True, tile_sizes=tiles
            ),
            "wgrad x^T dh": lambda: gg._weight_grad_triton(x, a, counts, tiles),
        }
    flops = 2 * rows * hidden * ffn
    weight_bytes = experts * hidden * ffn * 2
    results = []
    for name in grouped:
        row = [name, median_ms(dense[name]), median_ms(grouped[name])]
        row.append(median_ms(triton[name]) if name in triton else float("nan"))
        results.append(row)
    return results, flops, weight_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", type=int, nargs="+", default=list(range(len(CONFIGS))))
    parser.add_argument("--triton", action="store_true", help="also our Triton grouped GEMM")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, median of 20")
    print("| config | product | dense ms | _grouped_mm ms | Triton ms | dense TFLOP/s "
          "| grouped TFLOP/s | grouped x dense |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for index in args.configs:
        config = CONFIGS[index]
        results, flops, weight_bytes = products(*config, use_triton=args.triton)
        total = [0.0, 0.0]
        for name, dense_ms, grouped_ms, triton_ms in results:
            total[0] += dense_ms
            total[1] += grouped_ms
            print(
                f"| {config} | {name} | {dense_ms:.3f} | {grouped_ms:.3f} | {triton_ms:.3f} "
                f"| {flops / dense_ms / 1e9:.0f} | {flops / grouped_ms / 1e9:.0f} "
                f"| {grouped_ms / dense_ms:.2f} |"
            )
        print(
            f"| {config} | all six (expert weights {weight_bytes / 2**20:.0f} MiB each) "
            f"| {total[0]:.3f} | {total[1]:.3f} | | | | {total[1] / total[0]:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
