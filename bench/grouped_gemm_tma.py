"""The persistent TMA grouped GEMM of bench/kernels/grouped_gemm_tma.py against torch._grouped_mm
(CUTLASS) and the dense matmul of the same shape, for the six expert products of one dMoE step;
then, with --gather-configs, the four products whose row operand is a gather of token rows, fused
(read through the index) against index_select followed by torch._grouped_mm.

    python -m bench.grouped_gemm_tma [--configs 0 1 2] [--gather-configs 2]

Each time is the median over 5 replays of a CUDA graph of 20 calls: the GPU's time, without the
host's setup work (offsets, allocations) between calls. Every result is checked
against torch._grouped_mm; a tile shape that does not fit or disagrees is reported and skipped.
"""

from __future__ import annotations

import argparse

import torch

from bench.grouped_products import _operands
from bench.kernels.grouped_gemm_tma import grouped_mm_tma, weight_grad_tma
from bench.moe_layer import CONFIGS, capture_graph, median_step_ms
from moe.kernels.grouped_gemm import TileSizes

# (block_m, block_n, block_k, group_m, warps, stages)
ROW_TILES = [
    TileSizes(128, 256, 64, 8, 8, 3),
    TileSizes(128, 256, 64, 16, 8, 3),
    TileSizes(128, 128, 64, 8, 4, 4),
    TileSizes(256, 128, 64, 8, 8, 3),
    TileSizes(128, 128, 128, 8, 8, 3),
]
WEIGHT_GRAD_TILES = [
    TileSizes(128, 256, 64, 0, 8, 3),
    TileSizes(128, 128, 64, 0, 4, 4),
    TileSizes(128, 128, 128, 0, 8, 3),
]


def median_ms(fn, calls=20, rounds=5) -> float:
    """Median over `rounds` replays of a CUDA graph of `calls` calls, in ms per call: the GPU's
    time alone. (Timed as launched, the host's setup work per call, in Python, sets the pace of
    the smallest products; docs/benchmark-log.md.)"""
    replay = capture_graph(fn, calls)
    replay()
    torch.cuda.synchronize()
    return median_step_ms(replay, steps=1, rounds=rounds) / calls


def relative_error(got, want) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def fastest(name, ours, want, tile_list):
    """(ms, tiles) of the fastest tile shape whose result matches `want`; prints each."""
    best = (float("nan"), None)
    for tiles in tile_list:
        try:
            error = relative_error(ours(tiles), want)
            ms = median_ms(lambda t=tiles: ours(t))
        except Exception as failure:  # a shape that does not fit this GPU: report, go on
            print(f"  {name} {tiles}: failed, {type(failure).__name__}: {str(failure)[:200]}")
            continue
        print(f"  {name} {tiles}: {ms:.3f} ms, relative error {error:.1e}", flush=True)
        if error < 1e-2 and not ms >= best[0]:
            best = (ms, tiles)
    return best


def products(config):
    hidden, ffn, experts, top_k, tokens = config
    counts, x, a, w1, w2 = _operands(hidden, ffn, experts, top_k, tokens)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    dy, dh = torch.randn_like(x), torch.randn_like(a)
    rows = x.shape[0]
    cases = [  # name, torch's product, ours (tiles -> result), dense (M, K, N), tile list
        ("fwd x@w1", lambda: torch._grouped_mm(x, w1, offs=offs),
         lambda t: grouped_mm_tma(x, w1, counts, tiles=t), (rows, hidden, ffn), ROW_TILES),
        ("fwd a@w2", lambda: torch._grouped_mm(a, w2, offs=offs),
         lambda t: grouped_mm_tma(a, w2, counts, tiles=t), (rows, ffn, hidden), ROW_TILES),
        ("dgrad dy@w2^T", lambda: torch._grouped_mm(dy, w2.transpose(1, 2), offs=offs),
         lambda t: grouped_mm_tma(dy, w2, counts, transpose_weight=True, tiles=t),
         (rows, hidden, ffn), ROW_TILES),
        ("dgrad dh@w1^T", lambda: torch._grouped_mm(dh, w1.transpose(1, 2), offs=offs),
         lambda t: grouped_mm_tma(dh, w1, counts, transpose_weight=True, tiles=t),
         (rows, ffn, hidden), ROW_TILES),
        ("wgrad a^T dy", lambda: torch._grouped_mm(a.t(), dy, offs=offs),
         lambda t: weight_grad_tma(a, dy, counts, tiles=t), (ffn, rows, hidden), WEIGHT_GRAD_TILES),
        ("wgrad x^T dh", lambda: torch._grouped_mm(x.t(), dh, offs=offs),
         lambda t: weight_grad_tma(x, dh, counts, tiles=t), (hidden, rows, ffn), WEIGHT_GRAD_TILES),
    ]  # fmt: skip
    print(f"\nconfig {config}, about {rows // experts} rows per expert", flush=True)
    totals = [0.0, 0.0, 0.0]
    table = []
    for name, torch_fn, ours, (m, k, n), tile_list in cases:
        dense_a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        dense_b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        dense_ms = median_ms(lambda a=dense_a, b=dense_b: a @ b)
        torch_ms = median_ms(torch_fn)
        ours_ms, tiles = fastest(name, ours, torch_fn(), tile_list)
        table.append((name, dense_ms, torch_ms, ours_ms, tiles))
        del dense_a, dense_b
        for i, ms in enumerate((dense_ms, torch_ms, ours_ms)):
            totals[i] += ms
    print("| product | dense ms | torch._grouped_mm ms | TMA kernel ms | fastest tiles |")
    print("|---|---:|---:|---:|---|")
    for name, dense_ms, torch_ms, ours_ms, tiles in table:
        print(f"| {name} | {dense_ms:.3f} | {torch_ms:.3f} | {ours_ms:.3f} | {tiles} |")
    print(f"| six products | {totals[0]:.3f} | {totals[1]:.3f} | {totals[2]:.3f} | |", flush=True)


def gathered_products(config):
    hidden, ffn, experts, top_k, tokens = config
    generator = torch.Generator(device="cpu").manual_seed(1)
    # Each token's top_k distinct experts, sorted stably by expert as the layer sorts them.
    choice = torch.rand(tokens, experts, generator=generator).topk(top_k, dim=1).indices
    flat = choice.reshape(-1).cuda()
    order = torch.sort(flat, stable=True).indices
    token_of_row = order // top_k
    counts = torch.bincount(flat, minlength=experts).to(torch.int32)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = flat.numel()
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x, dy = torch.randn(tokens, hidden, **bf16), torch.randn(tokens, hidden, **bf16)
    a, dh = torch.randn(rows, ffn, **bf16), torch.randn(rows, ffn, **bf16)
    w1, w2 = torch.randn(experts, hidden, ffn, **bf16), torch.randn(experts, ffn, hidden, **bf16)

    def gathered(t):
        return t.index_select(0, token_of_row)

    print(f"\nconfig {config}, row operands gathered from {tokens} token rows into {rows}; "
          f"index_select alone {median_ms(lambda: gathered(x)):.3f} ms", flush=True)  # fmt: skip
    cases = [
        ("fwd x[i]@w1", lambda: torch._grouped_mm(gathered(x), w1, offs=offs),
         lambda t: grouped_mm_tma(x, w1, counts, row_index=token_of_row, tiles=t), ROW_TILES[:3]),
        ("dgrad dy[i]@w2^T", lambda: torch._grouped_mm(gathered(dy), w2.transpose(1, 2), offs=offs),
         lambda t: grouped_mm_tma(dy, w2, counts, transpose_weight=True, row_index=token_of_row,
                                  tiles=t), ROW_TILES[:3]),
        ("wgrad x[i]^T dh", lambda: torch._grouped_mm(gathered(x).t(), dh, offs=offs),
         lambda t: weight_grad_tma(x, dh, counts, row_index=token_of_row, gather="x", tiles=t),
         WEIGHT_GRAD_TILES),
        ("wgrad a^T dy[i]", lambda: torch._grouped_mm(a.t(), gathered(dy), offs=offs),
         lambda t: weight_grad_tma(a, dy, counts, row_index=token_of_row, gather="grad_out",
                                   tiles=t), WEIGHT_GRAD_TILES),
    ]  # fmt: skip
    table = []
    for name, torch_fn, ours, tile_list in cases:
        torch_ms = median_ms(torch_fn)
        ours_ms, tiles = fastest(name, ours, torch_fn(), tile_list)
        table.append((name, torch_ms, ours_ms, tiles))
    print(
        "| product | index_select + torch._grouped_mm ms | TMA kernel, gather fused, ms | tiles |"
    )
    print("|---|---:|---:|---|")
    for name, torch_ms, ours_ms, tiles in table:
        print(f"| {name} | {torch_ms:.3f} | {ours_ms:.3f} | {tiles} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--gather-configs", type=int, nargs="*", default=[2])
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for index in args.configs:
        products(CONFIGS[index])
    for index in args.gather_configs:
        gathered_products(CONFIGS[index])


if __name__ == "__main__":
    main()
