"""The router's top-k choice: torch.topk against moe.kernels.router_topk's one-pass kernel, on
fp32 softmax scores [tokens, experts], each checked against the other (the same scores chosen,
in the same order; where two scores tie the two may name different experts).

    python -m bench.router_topk

Each time is the median of 5 CUDA-graph replays of 20 calls (bench.timing.median_ms): the GPU's
time per call.
"""

from __future__ import annotations

import torch

from bench.timing import median_ms
from moe.kernels.router_topk import topk_indices

# (tokens, experts, k): the benchmark configurations' routers (16,384 tokens, 64 experts, top-8;
# 8,192 tokens, 8 experts, top-2) and a training micro-batch of 64 x 1,024 tokens.
SHAPES = [(16384, 64, 8), (8192, 8, 2), (65536, 64, 2), (65536, 64, 8)]
# Timed as launched, the host's work per call, longer than the kernel's, would set the pace.
REPLAYS = dict(graph_calls=20, repeats=5, warmup=3)


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    print("| tokens, experts, k | torch.topk ms | router_topk ms | same scores chosen |")
    print("|---|---:|---:|---|")
    for tokens, experts, k in SHAPES:
        scores = torch.randn(tokens, experts, device="cuda").softmax(-1)
        # The same scores chosen, in the same order (indices may differ where scores tie).
        same = torch.equal(scores.gather(1, topk_indices(scores, k)), torch.topk(scores, k).values)
        torch_ms = median_ms(lambda s=scores, k=k: torch.topk(s, k, dim=-1), **REPLAYS)
        ours_ms = median_ms(lambda s=scores, k=k: topk_indices(s, k), **REPLAYS)
        print(f"| {tokens}, {experts}, {k} | {torch_ms:.4f} | {ours_ms:.4f} | {same} |")


if __name__ == "__main__":
    main()
