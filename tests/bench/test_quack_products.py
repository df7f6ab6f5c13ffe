"""bench/quack_products.py without a GPU or QuACK: the cu_seqlens it builds, the routing behind
--quack-gather, the check's one-line reports, and each product's mapping onto QuACK's varlen
gemm, run against a stand-in that computes what quack.gemm_interface.gemm documents and asserts
the operand layouts its kernels assert (quack-kernels 0.6.5; tests/quack_stand_in.py, installed by
the `stand_in_quack` fixture)."""

import math

import torch

from bench.expert_shapes import LayerShape, expert_products
from bench.grouped_products import _operands, grouped_call
from bench.quack_products import (
    checked,
    gathered_calls,
    gathered_lines,
    quack_call,
    relative_error,
    token_routing,
    varlen_offsets,
)

# Small enough for the CPU, every row stride a multiple of 16 bytes as torch._grouped_mm asks.
SMALL = LayerShape("small", hidden=16, ffn=32, experts=4, top_k=2, tokens=24, gated=True)


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


def test_the_gather_table_says_failed_for_an_unchecked_result():
    lines = gathered_lines(
        [(SMALL, "fwd x@w1", 0.1, 0.5, 0.25), (SMALL, "fwd x@v1", 0.1, 0.5, math.nan)]
    )
    assert lines[2].endswith("| fwd x@w1 | 0.100 | 0.500 | 0.250 | 0.50 |")
    assert lines[3].endswith("| fwd x@v1 | 0.100 | 0.500 | failed | - |")
