"""Counting tokens per expert and sorting assignments by expert: Triton kernels and references.

An "assignment" a in [0, T * top_k) is token a // top_k's (a % top_k)-th expert choice. Sorting is a
stable counting sort in three kernels: per-block expert counts, one program that turns them into
each block's first slot per expert, and a scatter that ranks each assignment inside its block.
The bins helpers are a cumsum in PyTorch on E numbers; there is nothing for a kernel to win there.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.kernels.dispatch import TRITON_AVAILABLE, use_triton

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from megatron.kernels.aot import AotSpec

# The in-block rank compares every pair of a block's assignments, so this block stays small.
SORT_BLOCK = 128
HISTOGRAM_BLOCK = 256


if TRITON_AVAILABLE:

    @triton.jit
    def _expert_count_kernel(
        expert_indices_ptr,
        counts_ptr,
        num_assignments,
        num_experts,
        ACCUMULATE: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        """Counts one block's assignments per expert; adds them to counts or stores them as row
        pid."""
        block = tl.program_id(0)
        offsets = block * BLOCK + tl.arange(0, BLOCK)
        experts = tl.load(expert_indices_ptr + offsets, mask=offsets < num_assignments, other=-1)
        bins = tl.arange(0, BLOCK_E)
        counts = tl.sum((experts[:, None] == bins[None, :]).to(tl.int32), axis=0)
        if ACCUMULATE:
            tl.atomic_add(counts_ptr + bins, counts, mask=bins < num_experts)
        else:
            tl.store(counts_ptr + block * num_experts + bins, counts, mask=bins < num_experts)

    @triton.jit
    def _block_offsets_kernel(
        block_counts_ptr,
        tokens_per_expert_ptr,
        block_offsets_ptr,
        num_blocks,
        num_experts,
        BLOCK_E: tl.constexpr,
    ):
        """One program: totals per expert, then each block's first sorted slot for every expert."""
        bins = tl.arange(0, BLOCK_E)
        mask = bins < num_experts
        # while, not range(): triton 3.6's interpreter cannot range() over a runtime int with
        # numpy 2.4.
        total = tl.zeros([BLOCK_E], dtype=tl.int32)
        block = 0
        while block < num_blocks:
            total += tl.load(block_counts_ptr + block * num_experts + bins, mask=mask, other=0)
            block += 1
        tl.store(tokens_per_expert_ptr + bins, total, mask=mask)
        running = tl.cumsum(total, 0) - total
        block = 0
        while block < num_blocks:
            tl.store(block_offsets_ptr + block * num_experts + bins, running, mask=mask)
            running += tl.load(block_counts_ptr + block * num_experts + bins, mask=mask, other=0)
            block += 1

    @triton.jit
    def _sort_scatter_kernel(
        expert_indices_ptr,
        block_offsets_ptr,
        bin_ids_ptr,
        indices_ptr,
        num_assignments,
        num_experts,
        BLOCK: tl.constexpr,
    ):
        """Writes each assignment to its block's first slot for its expert plus its rank in the
        block."""
        block = tl.program_id(0)
        local = tl.arange(0, BLOCK)
        offsets = block * BLOCK + local
        mask = offsets < num_assignments
        experts = tl.load(expert_indices_ptr + offsets, mask=mask, other=-1)
        # Earlier assignments of the same expert in this block: this is what makes the sort stable.
        earlier = (experts[:, None] == experts[None, :]) & (local[None, :] < local[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        base = tl.load(block_offsets_ptr + block * num_experts + experts, mask=mask, other=0)
        positions = base + rank
        tl.store(bin_ids_ptr + positions, experts, mask=mask)
        tl.store(indices_ptr + positions, offsets, mask=mask)


def _block_e(num_experts: int) -> int:
    return max(triton.next_power_of_2(num_experts), 2)


def _check_expert_indices(expert_indices: torch.Tensor) -> None:
    if expert_indices.dim() != 1 or expert_indices.dtype.is_floating_point:
        raise ValueError(
            f"expert_indices must be a 1-D integer tensor [tokens * top_k], got dtype "
            f"{expert_indices.dtype} shape {tuple(expert_indices.shape)}; flatten the router's "
            "top-k indices first"
        )


def expert_histogram_reference(expert_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert, int32 [num_experts] (plain PyTorch)."""
    _check_expert_indices(expert_indices)
    return torch.bincount(expert_indices.long(), minlength=num_experts)[:num_experts].int()


def expert_histogram(expert_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert, int32 [num_experts]; indices outside [0, E) are not counted."""
    _check_expert_indices(expert_indices)
    if not use_triton(expert_indices):
        return expert_histogram_reference(expert_indices, num_experts)
    expert_indices = expert_indices.contiguous().int()
    counts = torch.zeros(num_experts, dtype=torch.int32, device=expert_indices.device)
    num_assignments = expert_indices.numel()
    if num_assignments == 0:
        return counts
    grid = (triton.cdiv(num_assignments, HISTOGRAM_BLOCK),)
    _expert_count_kernel[grid](
        expert_indices,
        counts,
        num_assignments,
        num_experts,
        ACCUMULATE=True,
        BLOCK=HISTOGRAM_BLOCK,
        BLOCK_E=_block_e(num_experts),
    )
    return counts


def sort_by_expert_reference(
    expert_indices: torch.Tensor, num_experts: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable sort by expert: (bin_ids, indices), indices[i] = the assignment at sorted slot i."""
    _check_expert_indices(expert_indices)
    bin_ids, indices = torch.sort(expert_indices.int(), stable=True)
    return bin_ids, indices.int()


def sort_by_expert(
    expert_indices: torch.Tensor, num_experts: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable sort by expert: (bin_ids, indices), both int32 [T * top_k].

    Pass num_experts to skip the host sync that finds it from the largest index.
    """
    _check_expert_indices(expert_indices)
    if not use_triton(expert_indices):
        return sort_by_expert_reference(expert_indices, num_experts)
    expert_indices = expert_indices.contiguous().int()
    num_assignments = expert_indices.numel()
    device = expert_indices.device
    bin_ids = torch.empty(num_assignments, dtype=torch.int32, device=device)
    indices = torch.empty(num_assignments, dtype=torch.int32, device=device)
    if num_assignments == 0:
        return bin_ids, indices
    if num_experts is None:
        num_experts = int(expert_indices.max().item()) + 1
    num_blocks = triton.cdiv(num_assignments, SORT_BLOCK)
    block_counts = torch.empty(num_blocks, num_experts, dtype=torch.int32, device=device)
    block_offsets = torch.empty_like(block_counts)
    tokens_per_expert = torch.empty(num_experts, dtype=torch.int32, device=device)
    block_e = _block_e(num_experts)
    _expert_count_kernel[(num_blocks,)](
        expert_indices,
        block_counts,
        num_assignments,
        num_experts,
        ACCUMULATE=False,
        BLOCK=SORT_BLOCK,
        BLOCK_E=block_e,
    )
    _block_offsets_kernel[(1,)](
        block_counts, tokens_per_expert, block_offsets, num_blocks, num_experts, BLOCK_E=block_e
    )
    _sort_scatter_kernel[(num_blocks,)](
        expert_indices,
        block_offsets,
        bin_ids,
        indices,
        num_assignments,
        num_experts,
        BLOCK=SORT_BLOCK,
    )
    return bin_ids, indices


def expert_bins(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Inclusive end offset of each expert's rows in sorted order, int32 [E]."""
    return torch.cumsum(tokens_per_expert, 0).int()


def padded_bins(tokens_per_expert: torch.Tensor, block_size: int) -> torch.Tensor:
    """Inclusive ends after rounding each expert's count up to a multiple of block_size, int32 [E]."""
    if block_size <= 0:
        raise ValueError(f"padded_bins: block_size must be positive, got {block_size}")
    padded = (tokens_per_expert.long() + block_size - 1) // block_size * block_size
    return torch.cumsum(padded, 0).int()


_COUNT = {"expert_indices_ptr": "*i32", "counts_ptr": "*i32"}
_SIZES = {"num_assignments": "i32", "num_experts": "i32"}
AOT_SPECS = (
    [
        AotSpec(
            kernel=_expert_count_kernel,
            signature={**_COUNT, **_SIZES},
            constexprs={"ACCUMULATE": accumulate, "BLOCK": block, "BLOCK_E": 64},
        )
        for accumulate, block in ((True, HISTOGRAM_BLOCK), (False, SORT_BLOCK))
    ]
    + [
        AotSpec(
            kernel=_block_offsets_kernel,
            signature={
                "block_counts_ptr": "*i32",
                "tokens_per_expert_ptr": "*i32",
                "block_offsets_ptr": "*i32",
                "num_blocks": "i32",
                "num_experts": "i32",
            },
            constexprs={"BLOCK_E": 64},
        ),
        AotSpec(
            kernel=_sort_scatter_kernel,
            signature={
                "expert_indices_ptr": "*i32",
                "block_offsets_ptr": "*i32",
                "bin_ids_ptr": "*i32",
                "indices_ptr": "*i32",
                **_SIZES,
            },
            constexprs={"BLOCK": SORT_BLOCK},
        ),
    ]
    if TRITON_AVAILABLE
    else []
)
