"""The router's top-k expert choice in one pass over the scores, as an op torch.compile keeps whole.

torch.topk on the router's [tokens, experts] scores runs a radix selection and then a bitonic
sort of the k winners, two kernels that take several times as long as one pass over the 2-4 MiB
of scores (docs/benchmark-log.md). The kernel here reads each token's scores once and takes the
largest k by k rounds of a row maximum, in registers.

`topk_indices(scores, k)` -> int64 [tokens, k]: each token's k highest-scoring experts in
descending order of score, ties to the lower expert index (torch.topk leaves the order of ties
open; this op fixes it, so that kernel and reference agree exactly). NaN ranks above every
number, as in torch.topk. Only the indices: the router gathers the weights from the scores, so
that their gradient flows as before.

Like the other ops of moe.kernels it is a `torch.library` custom op that runs its Triton kernel
where `use_triton` says so and its pure-PyTorch reference (a stable sort) otherwise.
"""

# No `from __future__ import annotations`: torch.library.custom_op reads the op's signature from
# its annotations, and older torch (2.4) does not resolve string annotations.

import torch

from megatron.kernels.dispatch import TRITON_AVAILABLE, use_triton

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from megatron.kernels.aot import AotSpec

# Tokens per program: 32 tokens x 64 experts of fp32 is 8 KiB of scores in registers.
BLOCK_TOKENS = 32
# Wider rows than this would spill the registers; the op falls back to the reference there.
MAX_EXPERTS = 1024


def topk_indices_reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest per row, descending, ties to the lower index, NaN first."""
    ranked = torch.where(torch.isnan(scores), float("inf"), scores.float())
    return torch.sort(ranked, dim=-1, descending=True, stable=True).indices[:, :k].contiguous()


if TRITON_AVAILABLE:

    @triton.jit
    def _topk_kernel(
        scores_ptr,
        out_ptr,
        num_tokens,
        num_experts,
        K: tl.constexpr,
        BLOCK_TOKENS: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        tokens = tl.program_id(0) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
        experts = tl.arange(0, BLOCK_E)
        token_mask = tokens < num_tokens
        mask = token_mask[:, None] & (experts[None, :] < num_experts)
        values = tl.load(
            scores_ptr + tokens.to(tl.int64)[:, None] * num_experts + experts[None, :],
            mask=mask,
            other=0.0,
        ).to(tl.float32)
        # NaN above every number, as torch.topk ranks it. Padding columns count as taken.
        # (`taken` is int32, not a boolean mask: Triton 3.0's interpreter cannot invert one.)
        values = tl.where(values != values, float("inf"), values)
        columns = tl.zeros((BLOCK_TOKENS, BLOCK_E), dtype=tl.int32) + experts[None, :]
        taken = (columns >= num_experts).to(tl.int32)
        for choice in tl.static_range(K):
            candidates = tl.where(taken != 0, float("-inf"), values)
            best = tl.max(candidates, axis=1)
            # The lowest untaken index at the maximum: -inf scores tie with taken columns.
            is_best = (candidates == best[:, None]) & (taken == 0)
            index = tl.min(tl.where(is_best, columns, BLOCK_E), axis=1)
            tl.store(out_ptr + tokens * K + choice, index.to(tl.int64), mask=token_mask)
            taken = tl.where(columns == index[:, None], 1, taken)


def _topk_triton(scores: torch.Tensor, k: int) -> torch.Tensor:
    scores = scores.contiguous()
    tokens, experts = scores.shape
    out = torch.empty(tokens, k, device=scores.device, dtype=torch.int64)
    if out.numel() == 0:
        return out
    grid = (triton.cdiv(tokens, BLOCK_TOKENS),)
    _topk_kernel[grid](
        scores,
        out,
        tokens,
        experts,
        K=k,
        BLOCK_TOKENS=BLOCK_TOKENS,
        BLOCK_E=max(16, triton.next_power_of_2(experts)),
    )
    return out


@torch.library.custom_op("moe::topk_indices", mutates_args=())
def _topk_indices_op(scores: torch.Tensor, k: int) -> torch.Tensor:
    if scores.shape[1] <= MAX_EXPERTS and use_triton(scores):
        return _topk_triton(scores, k)
    return topk_indices_reference(scores, k)


@_topk_indices_op.register_fake
def _(scores, k):
    return scores.new_empty(scores.shape[0], k, dtype=torch.int64)


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's k highest-scoring columns, [tokens, k] int64, descending, ties to the lower
    index. `scores` [tokens, experts] is not differentiated through (indices have no gradient)."""
    if scores.dim() != 2 or not 1 <= k <= scores.shape[1]:
        raise ValueError(
            f"topk_indices needs scores [tokens, experts] and 1 <= k <= experts; got "
            f"{tuple(scores.shape)} and k={k} (moe/kernels/router_topk.py)"
        )
    return _topk_indices_op(scores.detach(), k)


def _aot_specs() -> list:
    return [
        AotSpec(
            kernel=_topk_kernel,
            signature={
                "scores_ptr": f"*{dtype}",
                "out_ptr": "*i64",
                "num_tokens": "i32",
                "num_experts": "i32",
            },
            constexprs={"K": 8, "BLOCK_TOKENS": BLOCK_TOKENS, "BLOCK_E": 64},
        )
        for dtype in ("fp32", "bf16")
    ]


# What `python tools/compile_kernels.py` builds: k = 8 of 64 experts, fp32 and bf16 scores.
AOT_SPECS = _aot_specs() if TRITON_AVAILABLE else []
