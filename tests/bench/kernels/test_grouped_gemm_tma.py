"""The persistent TMA grouped GEMM of bench/kernels (run by Triton's CPU interpreter) against the
grouped_mm references, plain and with its row operand gathered through an index."""

import pytest
import torch

from bench.kernels import grouped_gemm_tma
from moe.kernels import grouped_gemm

pytestmark = [
    pytest.mark.skipif(
        not grouped_gemm_tma.available(),
        reason="this Triton has no device-side tensor descriptors (before 3.4)",
    ),
    pytest.mark.usefixtures("triton_kernels"),
]

# Small tiles, and (programs=4 on CPU) several tiles per program: the persistent loop is walked.
TILES = grouped_gemm.TileSizes(
    block_m=16, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=2
)

# (tokens per expert, K, N): empty experts, partial row tiles, N off the tile.
CASES = [
    ([5, 0, 40, 19], 32, 48),
    ([16, 16, 16], 16, 32),
    ([0, 3, 0, 33, 1], 48, 40),
]


def _assert_close(actual, expected, rtol=1e-5):
    scale = expected.abs().max().clamp_min(1e-6)
    error = (actual.double() - expected.double()).abs().max() / scale
    assert error <= rtol, f"relative error {error:.2e} > {rtol:.0e}"


def _weight_grad_reference(x, grad_out, counts):
    grads, start = [], 0
    for count in counts.tolist():
        grads.append(x[start : start + count].t() @ grad_out[start : start + count])
        start += count
    return torch.stack(grads)


@pytest.mark.parametrize("counts,k,n", CASES)
@pytest.mark.parametrize("transpose_weight", [False, True])
def test_rows_match_reference(counts, k, n, transpose_weight):
    generator = torch.Generator().manual_seed(0)
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), k, generator=generator)
    weight = torch.randn(
        len(counts), *((n, k) if transpose_weight else (k, n)), generator=generator
    )
    got = grouped_gemm_tma.grouped_mm_tma(
        x, weight, counts, transpose_weight=transpose_weight, tiles=TILES
    )
    want = grouped_gemm.grouped_mm_reference(
        x, weight.transpose(1, 2) if transpose_weight else weight, counts
    )
    _assert_close(got, want)


@pytest.mark.parametrize("counts,k,n", CASES)
@pytest.mark.parametrize("transpose_weight", [False, True])
def test_gathered_rows_match_reference(counts, k, n, transpose_weight):
    generator = torch.Generator().manual_seed(1)
    counts = torch.tensor(counts)
    tokens = 23
    x = torch.randn(tokens, k, generator=generator)
    row_index = torch.randint(0, tokens, (int(counts.sum()),), generator=generator)
    weight = torch.randn(
        len(counts), *((n, k) if transpose_weight else (k, n)), generator=generator
    )
    got = grouped_gemm_tma.grouped_mm_tma(
        x, weight, counts, transpose_weight=transpose_weight, row_index=row_index, tiles=TILES
    )
    want = grouped_gemm.grouped_mm_reference(
        x[row_index], weight.transpose(1, 2) if transpose_weight else weight, counts
    )
    _assert_close(got, want)


@pytest.mark.parametrize("counts,k,n", CASES)
@pytest.mark.parametrize("gather", [None, "x", "grad_out"])
def test_weight_grad_matches_reference(counts, k, n, gather):
    generator = torch.Generator().manual_seed(2)
    counts = torch.tensor(counts)
    rows, tokens = int(counts.sum()), 29
    row_index = torch.randint(0, tokens, (rows,), generator=generator) if gather else None
    x = torch.randn(tokens if gather == "x" else rows, k, generator=generator)
    grad_out = torch.randn(tokens if gather == "grad_out" else rows, n, generator=generator)
    got = grouped_gemm_tma.weight_grad_tma(
        x, grad_out, counts, row_index=row_index, gather=gather, tiles=TILES
    )
    want = _weight_grad_reference(
        x[row_index] if gather == "x" else x,
        grad_out[row_index] if gather == "grad_out" else grad_out,
        counts,
    )
    # Experts without rows get zeros, the gradient they must get.
    _assert_close(got, want)


def test_refuses_shapes_it_cannot_tile():
    counts = torch.tensor([3, 4])
    with pytest.raises(ValueError, match="multiple of block_k"):
        grouped_gemm_tma.grouped_mm_tma(
            torch.randn(7, 24), torch.randn(2, 24, 32), counts, tiles=TILES
        )
    with pytest.raises(ValueError, match="multiple of block_m"):
        grouped_gemm_tma.weight_grad_tma(
            torch.randn(7, 24), torch.randn(7, 32), counts, tiles=TILES
        )
    with pytest.raises(ValueError, match="gather must be"):
        grouped_gemm_tma.weight_grad_tma(
            torch.randn(7, 16), torch.randn(7, 32), counts, row_index=torch.zeros(7), gather="y"
        )
