"""Block-sparse topology of the dMoE expert MLP: which [B, B] blocks of [M, E*F] are nonzero."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Topology:
    """Nonzero blocks of an [num_rows, num_columns] matrix stored as data [nnz, B, B].

    Row-major order (the order of `data`): block k sits at row block `row_indices[k]`, column
    block `column_indices[k]`; row block r owns blocks `offsets[r]:offsets[r + 1]`.
    Column-major order (for the transposed products): the j-th block of column block c, for
    j in `column_offsets[c]:column_offsets[c + 1]`, sits at row block `row_indices_t[j]` and
    is `data[block_permutation_t[j]]`. All index tensors are int32 on the device of the bins.
    """

    block_size: int
    num_rows: int
    num_columns: int
    row_indices: torch.Tensor
    column_indices: torch.Tensor
    offsets: torch.Tensor
    column_offsets: torch.Tensor
    row_indices_t: torch.Tensor
    block_permutation_t: torch.Tensor

    @property
    def nnz(self) -> int:
        """Number of nonzero [B, B] blocks."""
        return self.row_indices.numel()

    @property
    def num_row_blocks(self) -> int:
        return self.num_rows // self.block_size

    @property
    def num_column_blocks(self) -> int:
        return self.num_columns // self.block_size

    @classmethod
    def from_padded_bins(
        cls, padded_bins: torch.Tensor, ffn_per_expert: int, block_size: int
    ) -> Topology:
        """Topology of the dMoE first-layer activation for experts of `ffn_per_expert` columns.

        `padded_bins[e]` is the (inclusive) cumulative count of padded rows up to expert e, so
        expert e owns rows `padded_bins[e - 1]:padded_bins[e]` and columns `e*F:(e+1)*F`.
        """
        _check_block_size(block_size)
        if ffn_per_expert <= 0 or ffn_per_expert % block_size:
            raise ValueError(
                f"Topology.from_padded_bins: ffn_per_expert={ffn_per_expert} must be a positive "
                f"multiple of block_size={block_size}; pad the expert FFN size or pick a block size "
                "that divides it."
            )
        if padded_bins.dim() != 1 or padded_bins.numel() == 0:
            raise ValueError(
                "Topology.from_padded_bins: padded_bins must be a non-empty 1-D tensor (one "
                f"cumulative row count per expert), got shape {tuple(padded_bins.shape)}."
            )
        # One host sync: the block counts decide the sizes of every index tensor.
        bins = [int(b) for b in padded_bins.tolist()]
        ends = [0, *bins]
        for expert, (start, end) in enumerate(zip(ends[:-1], ends[1:])):
            if end < start or end % block_size:
                raise ValueError(
                    f"Topology.from_padded_bins: padded_bins[{expert}]={end} must be a "
                    f"nondecreasing multiple of block_size={block_size} (previous end {start}); "
                    "pad each expert's token count up to a multiple of the block size."
                )
        device = padded_bins.device
        num_experts = len(bins)
        blocks_per_row = ffn_per_expert // block_size
        num_row_blocks = bins[-1] // block_size
        num_column_blocks = num_experts * blocks_per_row
        row_blocks_per_expert = torch.tensor(
            [(end - start) // block_size for start, end in zip(ends[:-1], ends[1:])],
            device=device,
        )

        expert_of_row = torch.repeat_interleave(
            torch.arange(num_experts, device=device), row_blocks_per_expert
        )
        row_indices = torch.arange(num_row_blocks, device=device).repeat_interleave(blocks_per_row)
        column_indices = (expert_of_row * blocks_per_row).repeat_interleave(
            blocks_per_row
        ) + torch.arange(blocks_per_row, device=device).repeat(num_row_blocks)
        offsets = torch.arange(num_row_blocks + 1, device=device) * blocks_per_row

        # Row indices ascend in row-major order, so a stable sort by column yields column-major
        # order with rows still ascending inside each column.
        _, block_permutation_t = torch.sort(column_indices, stable=True)
        blocks_per_column = torch.bincount(column_indices, minlength=num_column_blocks)
        column_offsets = torch.cat(
            [torch.zeros(1, dtype=torch.long, device=device), blocks_per_column.cumsum(0)]
        )

        def int32(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(torch.int32).contiguous()

        return cls(
            block_size=block_size,
            num_rows=bins[-1],
            num_columns=num_experts * ffn_per_expert,
            row_indices=int32(row_indices),
            column_indices=int32(column_indices),
            offsets=int32(offsets),
            column_offsets=int32(column_offsets),
            row_indices_t=int32(row_indices[block_permutation_t]),
            block_permutation_t=int32(block_permutation_t),
        )


def _check_block_size(block_size: int) -> None:
    # tl.dot needs tiles of at least 16 and tl.arange needs a power of two.
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(
            f"Topology: block_size={block_size} must be a power of two >= 16 (128 on GPU)."
        )
