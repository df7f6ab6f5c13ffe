"""bench/quack_products.py without a GPU or QuACK: the cu_seqlens it builds, the routing behind
--quack-gather, the check's one-line reports, and each product's mapping onto QuACK's varlen
gemm, run against a stand-in that computes what quack.gemm_interface.gemm documents and asserts
the operand layouts its kernels assert (quack-kernels 0.6.5)."""

import math
import sys
import types

import pytest
import torch

from bench.expert_shapes import LayerShape, expert_products
from bench.grouped_products import _operands, grouped_call
from bench.quack_products import (
    checked,
    gathered_calls,
    gathered_lines,
    quack_call,
    quack_missing,
    relative_error,
    token_routing,
    varlen_offsets,
)

# Small enough for the CPU, every row stride a multiple of 16 bytes as torch._grouped_mm asks.
SMALL = LayerShape("small", hidden=16, ffn=32, experts=4, top_k=2, tokens=24, gated=True)


def _varlen_gemm(A, B, out=None, *, cu_seqlens_m=None, cu_seqlens_k=None, A_idx=None, tuned=True):
    """QuACK's gemm for a varlen M (A [total_M, K], or rows of it by A_idx; B [L, K, N]) or a
    varlen K (A [M, total_K], B [total_K, N]), with QuACK's layout asserts."""
    assert (cu_seqlens_m is None) != (cu_seqlens_k is None)
    cu_seqlens = cu_seqlens_m if cu_seqlens_k is None else cu_seqlens_k
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.dim() == 1 and cu_seqlens[0] == 0
    bounds = list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
    if cu_seqlens_m is not None:
        assert A.stride(-1) == 1, "varlen_m requires A to be k-major"
        assert 1 in B.stride()[-2:] and B.shape[0] == len(bounds)
        if A_idx is not None:
            assert A_idx.dtype == torch.int32 and A_idx.shape == (cu_seqlens[-1],)
            A = A[A_idx.long()]
        assert A.shape[0] == cu_seqlens[-1]
        parts = [A[start:end].float() @ B[e].float() for e, (start, end) in enumerate(bounds)]
        return torch.cat(parts).to(A.dtype)
    assert A.stride(-2) == 1, "varlen_k requires A to be m-major"
    assert B.stride(-1) == 1, "varlen_k requires B to be n-major"
    assert A.shape[1] == B.shape[0] == cu_seqlens[-1]
    parts = [A[:, start:end].float() @ B[start:end].float() for start, end in bounds]
    return torch.stack(parts).to(A.dtype)


@pytest.fixture
def stand_in_quack(monkeypatch):
    package = types.ModuleType("quack")
    package.__version__ = "stand-in"
    interface = types.ModuleType("quack.gemm_interface")
    interface.gemm = _varlen_gemm
    package.gemm_interface = interface
    monkeypatch.setitem(sys.modules, "quack", package)
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", interface)


def test_cu_seqlens_are_a_zero_then_the_running_sums_in_int32():
    got = varlen_offsets(torch.tensor([3, 0, 2, 5]))
    assert got.dtype == torch.int32
    assert got.tolist() == [0, 3, 3, 5, 10]
    assert varlen_offsets(torch.tensor([4])).tolist() == [0, 4]


def test_the_gather_routing_copies_each_token_top_k_times_sorted_by_expert():
    counts, token_index = token_routing(SMALL, device="cpu")
    assert token_index.dtype == torch.int32 and token_index.shape == (SMALL.rows,)
    assert int(counts.sum()) == SMALL.rows and counts.shape == (SMALL.experts,)
    assert torch.bincount(token_index.long()).tolist() == [SMALL.top_k] * SMALL.tokens
    # The same draw as the products table's routing: its counts are _operands'.
    assert counts.tolist() == _operands(SMALL, device="cpu")[0].tolist()


def test_each_product_maps_onto_quacks_varlen_gemm(stand_in_quack, capsys):
    counts, offsets, tensors, _ = _operands(SMALL, device="cpu")
    cu_seqlens = varlen_offsets(counts)
    for product in expert_products(SMALL):
        want = grouped_call(product, offsets, tensors)()
        run = quack_call(product, cu_seqlens, tensors, tuned=False)
        assert run().shape == want.shape, product.name
        assert checked(product.name, run, want), product.name
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 9 and all("relative error" in line for line in lines)


def test_the_gathered_forward_matches_the_copy_then_grouped_mm(stand_in_quack):
    calls = gathered_calls(SMALL, tuned=False, device="cpu")
    assert [name for name, *_ in calls] == ["fwd x@w1", "fwd x@v1"]
    for _, copy, torch_way, quack_way in calls:
        assert copy().shape == (SMALL.rows, SMALL.hidden)
        assert relative_error(quack_way(), torch_way()) < 1e-2


def test_a_call_that_raises_or_a_wrong_result_fails_in_one_line(capsys):
    want = torch.ones(4, 4)

    def raises():
        raise RuntimeError("no kernel\nfor this config")

    assert not checked("raises", raises, want)
    assert not checked("wrong", lambda: 2 * want, want)
    assert not checked("nan", lambda: want * math.nan, want)
    assert checked("right", lambda: want + 1e-4, want)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "raises: failed: RuntimeError: no kernel for this config"
    assert lines[1].startswith("wrong: failed: relative error 1.0e+00")
    assert lines[2].startswith("nan: failed: ") and lines[3].startswith("right: relative error")


def test_quack_is_missing_where_it_does_not_import(monkeypatch, stand_in_quack):
    assert quack_missing() is None
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", None)
    missing = quack_missing()
    assert missing.startswith(("ImportError", "ModuleNotFoundError")) and "\n" not in missing


def test_the_gather_table_says_failed_for_an_unchecked_result():
    lines = gathered_lines(
        [(SMALL, "fwd x@w1", 0.1, 0.5, 0.25), (SMALL, "fwd x@v1", 0.1, 0.5, math.nan)]
    )
    assert lines[2].endswith("| fwd x@w1 | 0.100 | 0.500 | 0.250 | 0.50 |")
    assert lines[3].endswith("| fwd x@v1 | 0.100 | 0.500 | failed | - |")
