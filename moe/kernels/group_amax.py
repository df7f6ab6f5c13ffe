"""The largest magnitude of each column within each expert's rows: the scales of the FP8 weight
gradient's operands under the rowwise recipe (moe.kernels.fp8_grouped_gemm).

Rows [N, C] are grouped by expert: expert e owns rows [offsets[e - 1], offsets[e]) (`offsets` [E],
the int32 inclusive cumulative sums; rows after the last group belong to none).
`group_column_amax(rows, offsets)` is [E, C] in fp32: out[e, c] = max |rows[r, c]| over expert e's
rows, 0 for an expert without rows.

The reference scatters every row's magnitudes into its expert's row with scatter_reduce("amax"):
atomics on E x C targets, each hit by all of its expert's rows, which made it most of the
rowwise FP8 layer's overhead (docs/benchmark-log.md, "Where the FP8 dMoE layer's time goes").
The Triton kernel gives each (expert, tile of columns) to one program, which walks that
expert's rows and writes its maxima once: every row read once, no atomics. It is a
`torch.library` custom op, so torch.compile records it as one node.
"""

# No `from __future__ import annotations`: torch.library.custom_op reads the op's signature from
# its annotations, and older torch (2.4) does not resolve string annotations.

import torch
import torch.nn.functional as F

from megatron.kernels.dispatch import TRITON_AVAILABLE, use_triton

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from megatron.kernels.aot import AotSpec

# Rows per step and columns per program: 32 x 128 bf16 values (8 KiB) in flight per step.
BLOCK_ROWS = 32
BLOCK_COLUMNS = 128


def group_column_amax_reference(rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    experts = offsets.shape[0]
    positions = torch.arange(rows.shape[0], device=rows.device)
    # Each row's expert; rows after the last group get `experts`, a row of their own, dropped.
    group = torch.searchsorted(offsets.to(torch.int64), positions, right=True)
    magnitude = rows.abs().float()
    amax = magnitude.new_zeros(experts + 1, rows.shape[1])
    amax = amax.scatter_reduce(0, group[:, None].expand_as(magnitude), magnitude, "amax")
    return amax[:experts]


if TRITON_AVAILABLE:

    @triton.jit
    def _group_column_amax_kernel(
        rows_ptr,
        bounds_ptr,
        out_ptr,
        columns,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_COLUMNS: tl.constexpr,
    ):
        """out[e, cols] = max |rows[bounds[e]:bounds[e + 1], cols]| in fp32, for expert e =
        program 0 and a tile of columns = program 1; 0 where the expert has no rows."""
        expert = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)
        column_mask = cols < columns
        start = tl.load(bounds_ptr + expert)
        end = tl.load(bounds_ptr + expert + 1)
        amax = tl.zeros([BLOCK_COLUMNS], dtype=tl.float32)
        for first in range(start, end, BLOCK_ROWS):
            row = first + tl.arange(0, BLOCK_ROWS)
            mask = (row < end)[:, None] & column_mask[None, :]
            pointers = rows_ptr + row.to(tl.int64)[:, None] * columns + cols[None, :]
            values = tl.load(pointers, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(values), axis=0))
        tl.store(out_ptr + expert * columns + cols, amax, mask=column_mask)


def _group_column_amax_triton(rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    rows = rows.contiguous()
    experts, columns = offsets.shape[0], rows.shape[1]
    out = torch.empty(experts, columns, device=rows.device, dtype=torch.float32)
    if out.numel() == 0:
        return out
    bounds = F.pad(offsets.to(torch.int32), (1, 0))
    grid = (experts, triton.cdiv(columns, BLOCK_COLUMNS))
    _group_column_amax_kernel[grid](
        rows, bounds, out, columns, BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLUMNS=BLOCK_COLUMNS
    )
    return out


@torch.library.custom_op("moe::group_column_amax", mutates_args=())
def group_column_amax(rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[E, C] fp32: the largest magnitude of each column of `rows` [N, C] within each expert's
    rows (module docstring); no gradient (scales are not differentiated)."""
    if use_triton(rows, offsets):
        return _group_column_amax_triton(rows, offsets)
    return group_column_amax_reference(rows, offsets)


@group_column_amax.register_fake
def _(rows, offsets):
    return rows.new_empty(offsets.shape[0], rows.shape[1], dtype=torch.float32)


def _aot_specs() -> list:
    return [
        AotSpec(
            kernel=_group_column_amax_kernel,
            signature={
                "rows_ptr": f"*{dtype}",
                "bounds_ptr": "*i32",
                "out_ptr": "*fp32",
                "columns": "i32",
            },
            constexprs={"BLOCK_ROWS": BLOCK_ROWS, "BLOCK_COLUMNS": BLOCK_COLUMNS},
        )
        for dtype in ("bf16", "fp32")
    ]


# What `python tools/compile_kernels.py` builds: bf16 rows (training) and fp32 rows.
AOT_SPECS = _aot_specs() if TRITON_AVAILABLE else []
