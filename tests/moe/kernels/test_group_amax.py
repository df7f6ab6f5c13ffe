"""moe.kernels.group_amax, each column's largest magnitude within each expert's rows: the Triton
kernel (Triton's CPU interpreter) against the reference and against a per-expert definition."""

import pytest
import torch

from megatron.kernels.dispatch import TRITON_AVAILABLE
from moe.kernels.group_amax import group_column_amax, group_column_amax_reference

# Groups off the 32-row steps, an empty expert, and rows after the last group, which belong to
# no expert; columns off the 128-column tiles.
COUNTS = (5, 0, 70, 33)
TRAILING = 3


def _rows(columns: int, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(columns)
    rows = torch.randn(sum(COUNTS) + TRAILING, columns, generator=generator).to(dtype)
    rows[sum(COUNTS) :] = 1e6  # must not reach any expert's maximum
    return rows, torch.tensor(COUNTS).cumsum(0).to(torch.int32)


def _definition(rows: torch.Tensor) -> torch.Tensor:
    bounds = [0, *torch.tensor(COUNTS).cumsum(0).tolist()]
    return torch.stack([
        rows[start:end].abs().float().amax(0) if end > start else rows.new_zeros(rows.shape[1]).float()
        for start, end in zip(bounds[:-1], bounds[1:])
    ])  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_reference_is_the_definition(dtype):
    rows, offsets = _rows(200, dtype)
    assert torch.equal(group_column_amax_reference(rows, offsets), _definition(rows))


@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed")
@pytest.mark.parametrize("columns", [8, 200])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_gives_the_reference_exactly(columns, dtype):
    rows, offsets = _rows(columns, dtype)
    amax = group_column_amax(rows, offsets)
    assert amax.dtype == torch.float32 and amax.shape == (len(COUNTS), columns)
    assert torch.equal(amax, group_column_amax_reference(rows, offsets))


def test_the_op_compiles_as_one_graph():
    rows, offsets = _rows(64, torch.bfloat16)
    compiled = torch.compile(group_column_amax, fullgraph=True)
    assert torch.equal(compiled(rows, offsets), _definition(rows))
