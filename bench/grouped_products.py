"""The six expert products of one dMoE layer step, each timed alone, next to the dense matmul of
the same FLOPs: where the grouped layer's GEMM time goes (bench/moe_layer.py times the layer).

    python -m bench.grouped_products [--configs 0 1 2 3] [--tokens N] [--triton] [--sweep]
        [--layouts]

For expert weights w1 [E, h, f] and w2 [E, f, h] and N = tokens * top_k rows sorted by expert:
forward x @ w1, a @ w2; backward dy @ w2^T, a^T dy (weight gradient), dh @ w1^T, x^T dh. The
dense counterpart of each has the same M, N, K with one [K, N] weight (cuBLAS). Expert loads
follow a uniform random routing, as a freshly initialized router gives. `--sweep` times our Triton
kernels at each launch shape of SWEEP_ROW_TILES / SWEEP_WEIGHT_GRAD_TILES, checks each result
against torch._grouped_mm, and prints the fastest shape per product. `--layouts` times each
weight's three products (forward, input gradient, weight gradient) with the weight stored
[E, K, N] (N contiguous) and [E, N, K] (K contiguous): CUTLASS picks its kernel by operand
layout, and the two need not be equally fast at one shape. `--tokens N` replaces the
configurations' token count (65536 is the dMoE 125M's micro batch of 64 sequences on one GPU).
"""

from __future__ import annotations

import argparse
import functools

import torch

from bench.moe_layer import CONFIGS
from bench.timing import median_ms

# (block_m, block_n, block_k, group_m, num_warps, num_stages) tried by --sweep.
SWEEP_ROW_TILES = [
    (128, 128, 64, 8, 4, 4),
    (128, 128, 64, 8, 8, 3),
    (128, 256, 64, 8, 8, 3),
    (64, 256, 64, 8, 4, 4),
    (128, 64, 64, 8, 4, 4),
    (256, 128, 64, 8, 8, 3),
    (64, 128, 64, 8, 4, 4),
    (128, 128, 64, 16, 8, 4),
]
# For the weight gradient block_m tiles the weight's rows and block_k the tokens.
SWEEP_WEIGHT_GRAD_TILES = [
    (128, 128, 64, 1, 4, 3),
    (128, 128, 64, 1, 8, 4),
    (128, 256, 64, 1, 8, 3),
    (64, 128, 64, 1, 4, 4),
    (128, 128, 32, 1, 4, 4),
    (256, 128, 64, 1, 8, 3),
    (64, 256, 64, 1, 4, 4),
]


def _operands(hidden, ffn, experts, top_k, tokens):
    rows = tokens * top_k
    device, dtype = "cuda", torch.bfloat16
    generator = torch.Generator(device="cpu").manual_seed(0)
    choice = torch.randint(0, experts, (rows,), generator=generator)
    counts = torch.bincount(choice, minlength=experts).to(device)
    x = torch.randn(rows, hidden, device=device, dtype=dtype)
    a = torch.randn(rows, ffn, device=device, dtype=dtype)
    w1 = torch.randn(experts, hidden, ffn, device=device, dtype=dtype)
    w2 = torch.randn(experts, ffn, hidden, device=device, dtype=dtype)
    return counts, x, a, w1, w2


def sweep(hidden, ffn, experts, top_k, tokens):
    """[(product, _grouped_mm ms, best Triton ms, best shape, its relative error)]."""
    from moe.kernels import grouped_gemm as gg

    counts, x, a, w1, w2 = _operands(hidden, ffn, experts, top_k, tokens)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    row = functools.partial(gg._grouped_mm_triton, tokens_per_expert=counts)
    cases = {
        "fwd x@w1": (lambda: torch._grouped_mm(x, w1, offs=offsets),
                     (x, w1, False)),
        "fwd a@w2": (lambda: torch._grouped_mm(a, w2, offs=offsets),
                     (a, w2, False)),
        "dgrad dy@w2^T": (lambda: torch._grouped_mm(x, w2.transpose(-2, -1), offs=offsets),
                          (x, w2, True)),
        "wgrad a^T dy": (lambda: torch._grouped_mm(a.t(), x, offs=offsets), (a, x)),
        "dgrad dh@w1^T": (lambda: torch._grouped_mm(a, w1.transpose(-2, -1), offs=offsets),
                          (a, w1, True)),
        "wgrad x^T dh": (lambda: torch._grouped_mm(x.t(), a, offs=offsets), (x, a)),
    }  # fmt: skip
    results = []
    for name, (torch_fn, operands) in cases.items():
        want = torch_fn().float()
        if name.startswith("wgrad"):
            candidates = [
                ("ptr", shape, functools.partial(gg._weight_grad_triton, *operands, counts))
                for shape in SWEEP_WEIGHT_GRAD_TILES
            ]
        else:
            first, weight, transpose = operands
            candidates = [
                ("ptr", shape, functools.partial(row, first, weight, transpose_weight=transpose))
                for shape in SWEEP_ROW_TILES
            ]
        best = (float("inf"), None, float("nan"))
        for kind, shape, triton_fn in candidates:
            tiles = gg.TileSizes(*shape)
            try:
                run = functools.partial(triton_fn, tile_sizes=tiles)
                got = run().float()
                error = ((got - want).norm() / want.norm()).item()
                ms = median_ms(run) if error < 1e-2 else float("inf")
            except Exception as failure:  # out of shared memory, say: report and go on
                print(
                    f"{name} {kind} {shape}: {type(failure).__name__}: {failure}"[:300], flush=True
                )
                continue
            print(f"  {name} {kind} {shape}: {ms:.3f} ms, relative error {error:.1e}", flush=True)
            if ms < best[0]:
                best = (ms, (kind, *shape), error)
        results.append((name, median_ms(torch_fn), *best))
    return results


def products(hidden, ffn, experts, top_k, tokens, use_triton):
    rows = tokens * top_k
    counts, x, a, w1, w2 = _operands(hidden, ffn, experts, top_k, tokens)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    d1 = torch.randn(hidden, ffn, device="cuda", dtype=torch.bfloat16)
    d2 = torch.randn(ffn, hidden, device="cuda", dtype=torch.bfloat16)
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

        tiles = None  # gg.default_tile_sizes for the device
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


def _layout_products(rows_in, rows_out, weight, offsets):
    """Each product of one weight [E, K, N] with it stored as is and stored as [E, N, K]."""
    weight_t = weight.transpose(-2, -1).contiguous()
    mm = functools.partial(torch._grouped_mm, offs=offsets)
    kn = {
        "fwd": functools.partial(mm, rows_in, weight),
        "dgrad": functools.partial(mm, rows_out, weight.transpose(-2, -1)),
        "wgrad": functools.partial(mm, rows_in.t(), rows_out),
    }
    nk = {
        "fwd": functools.partial(mm, rows_in, weight_t.transpose(-2, -1)),
        "dgrad": functools.partial(mm, rows_out, weight_t),
        "wgrad": functools.partial(mm, rows_out.t(), rows_in),  # [E, N, K]
    }
    return kn, nk


def layouts(hidden, ffn, experts, top_k, tokens, repeats=2):
    """[(weight, product, [(ms stored [E, K, N], ms stored [E, N, K])] * repeats, max abs
    difference of the two results)]."""
    counts, x, a, w1, w2 = _operands(hidden, ffn, experts, top_k, tokens)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    results = []
    # (name, row input [M, K], row output gradient [M, N], weight [E, K, N])
    for name, rows_in, rows_out, weight in (("w1", x, a, w1), ("w2", a, x, w2)):
        kn, nk = _layout_products(rows_in, rows_out, weight, offsets)
        for product in kn:
            other = nk[product]().float()
            if product == "wgrad":
                other = other.transpose(-2, -1)
            same = (kn[product]().float() - other).abs().max().item()
            times = [(median_ms(kn[product]), median_ms(nk[product])) for _ in range(repeats)]
            results.append((name, product, times, same))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", type=int, nargs="+", default=list(range(len(CONFIGS))))
    parser.add_argument("--triton", action="store_true", help="also our Triton grouped GEMM")
    parser.add_argument("--sweep", action="store_true", help="Triton launch shapes, fastest each")
    parser.add_argument("--layouts", action="store_true", help="weights [E,K,N] against [E,N,K]")
    parser.add_argument("--tokens", type=int, default=None, help="instead of each config's")
    args = parser.parse_args()
    configs = [
        CONFIGS[index] if args.tokens is None else (*CONFIGS[index][:4], args.tokens)
        for index in args.configs
    ]
    if args.layouts:
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, median of 20")
        print("| config | weight | product | [E, K, N] ms | [E, N, K] ms | max abs difference |")
        print("|---|---|---|---|---|---:|")
        for config in configs:
            for name, product, times, same in layouts(*config):
                kn = " / ".join(f"{t[0]:.3f}" for t in times)
                nk = " / ".join(f"{t[1]:.3f}" for t in times)
                print(
                    f"| {config} | {name} | {product} | {kn} | {nk} | {same:.1e} |",
                    flush=True,
                )
        return
    if args.sweep:
        tables = []
        for config in configs:
            for row in sweep(*config):
                tables.append((config, *row))
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, median of 20")
        print("| config | product | _grouped_mm ms | best Triton ms | Triton / torch | shape "
              "(loads, bm, bn, bk, group, warps, stages) | rel. error |")  # fmt: skip
        print("|---|---|---:|---:|---:|---|---:|")
        for config, name, torch_ms, triton_ms, shape, error in tables:
            print(f"| {config} | {name} | {torch_ms:.3f} | {triton_ms:.3f} "
                  f"| {triton_ms / torch_ms:.2f} | {shape} | {error:.1e} |")  # fmt: skip
        return
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, median of 20")
    print("| config | product | dense ms | _grouped_mm ms | Triton ms | dense TFLOP/s "
          "| grouped TFLOP/s | grouped x dense |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for config in configs:
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
