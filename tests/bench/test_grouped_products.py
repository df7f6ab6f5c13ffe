"""bench/grouped_products.py without a GPU: the layers --shapes names, each product and its
dense twin (equal FLOPs, built on meta tensors at the real sizes), the table's sum row, the
command line and its one-line refusal where torch sees no GPU."""

import math
import sys

import pytest
import torch

from bench import grouped_products
from bench.expert_shapes import SHAPE_SETS, dense_dims, expert_products
from bench.grouped_products import (
    GROUPED_MM,
    QUACK,
    TRITON,
    _operands,
    dense_call,
    grouped_call,
    main,
    parse_args,
    selected_shapes,
    table_lines,
)

ALL_SHAPES = [shape for shapes in SHAPE_SETS.values() for shape in shapes]


def _flops(shape):
    return [2 * math.prod(dense_dims(product, shape)) for product in expert_products(shape)]


def test_the_granularity_layers_keep_the_active_flops_and_the_expert_weights():
    shapes = SHAPE_SETS["granularity"]
    dims = [(s.hidden, s.ffn, s.experts, s.top_k, s.tokens) for s in shapes]
    assert dims == [
        (768, 3072, 64, 1, 65536),
        (768, 768, 256, 4, 65536),
        (768, 384, 512, 8, 65536),
    ]
    assert {shape.weight_elements for shape in shapes} == {64 * 768 * 3072}
    for shape in shapes:
        assert len(expert_products(shape)) == 6
        # Each dense twin does its grouped product's FLOPs: 2 x (tokens x top-k) x h x f.
        assert _flops(shape) == [2 * 65536 * 768 * 3072] * 6


def test_olmoes_gated_layer_has_the_gates_three_products():
    (olmoe,) = SHAPE_SETS["olmoe"]
    assert (olmoe.hidden, olmoe.ffn, olmoe.experts, olmoe.top_k, olmoe.gated) == (
        2048, 1024, 64, 8, True,
    )  # fmt: skip
    products = expert_products(olmoe)
    assert [product.weight for product in products if product.weight] == [
        "w1", "v1", "w2", "w2", "w1", "v1",
    ]  # fmt: skip
    assert len(products) == 9
    assert _flops(olmoe) == [2 * olmoe.tokens * 8 * 2048 * 1024] * 9


@pytest.mark.parametrize("shape", ALL_SHAPES, ids=[shape.name for shape in ALL_SHAPES])
def test_each_grouped_product_and_its_dense_twin_multiply_the_named_sizes(shape):
    """On meta tensors of the real sizes: the dense twin is [M, K] @ [K, N] as dense_dims says
    (M = tokens x top-k for the forward and input gradients), and the grouped product gives the
    same output (a weight gradient: one per expert)."""
    counts, offsets, tensors, dense = _operands(shape, device="meta")
    assert int(counts.shape[0]) == shape.experts
    for product in expert_products(shape):
        m, _, n = dense_dims(product, shape)
        assert dense_call(product, tensors, dense)().shape == (m, n)
        want = (shape.experts, m, n) if product.weight is None else (m, n)
        if product.weight is not None:
            assert m == shape.tokens * shape.top_k
        assert grouped_call(product, offsets, tensors)().shape == want


def test_the_last_row_sums_every_product_against_dense():
    (olmoe,) = SHAPE_SETS["olmoe"]
    # Made-up inputs for the table: dense 1, 2, ..., 9; _grouped_mm 1.5x each; Triton 3 each.
    results = [
        (product.name, float(index), {GROUPED_MM: 1.5 * index, TRITON: 3.0})
        for index, product in enumerate(expert_products(olmoe), start=1)
    ]
    lines = table_lines(olmoe, results)
    assert len(lines) == 10
    assert lines[0].endswith("| 1.500 | 1.50 | 3.000 | 3.00 |")
    assert "| all 9 (3 expert weights of 256 MiB in bf16) | 45.000 |" in lines[-1]
    assert lines[-1].endswith("| 67.500 | 1.50 | 27.000 | 0.60 |")


def test_the_command_line_picks_the_layers():
    shapes = selected_shapes(parse_args(["--shapes", "granularity", "olmoe", "--tokens", "4096"]))
    assert [shape.name for shape in shapes] == [
        "dMoE-125M G=1", "dMoE-125M G=4", "dMoE-125M G=8", "OLMoE",
    ]  # fmt: skip
    assert {shape.tokens for shape in shapes} == {4096}
    assert [shape.name for shape in selected_shapes(parse_args(["--configs", "2"]))] == ["config 2"]
    with pytest.raises(SystemExit) as refused:
        parse_args(["--shapes", "olmoe", "--configs", "0"])
    assert refused.value.code == 2


def test_help_works_and_without_a_gpu_the_bench_says_so_in_one_line(monkeypatch, capsys):
    with pytest.raises(SystemExit) as helped:
        main(["--help"])
    assert helped.value.code == 0 and "--shapes" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(grouped_products, "time_products", None)  # never reached
    with pytest.raises(SystemExit) as refused:
        main(["--shapes", "granularity", "olmoe", "--triton"])
    message = refused.value.code
    assert isinstance(message, str) and "needs a CUDA GPU" in message and "\n" not in message


def test_a_quack_product_that_failed_its_check_shows_failed_and_so_does_the_sum():
    (olmoe,) = SHAPE_SETS["olmoe"]
    results = [
        (product.name, 1.0, {GROUPED_MM: 2.0, QUACK: math.nan if index == 3 else 1.5})
        for index, product in enumerate(expert_products(olmoe))
    ]
    lines = table_lines(olmoe, results)
    assert lines[0].endswith("| 2.000 | 2.00 | 1.500 | 1.50 |")
    assert lines[3].endswith("| 2.000 | 2.00 | failed | - |")
    assert lines[-1].endswith("| 18.000 | 2.00 | failed | - |")


def test_the_quack_flags_go_with_the_products_table():
    args = parse_args(["--quack", "--quack-tuned", "--quack-gather"])
    assert (args.quack, args.quack_tuned, args.quack_gather) == (True, True, True)
    for argv in (
        ["--quack-tuned"],
        ["--quack-gather"],
        ["--quack", "--sweep"],
        ["--quack", "--layouts"],
    ):
        with pytest.raises(SystemExit) as refused:
            parse_args(argv)
        assert refused.value.code == 2


def test_without_quack_the_bench_refuses_quack_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "quack", None)  # import quack raises ImportError
    monkeypatch.setattr(grouped_products, "time_products", None)  # never reached
    with pytest.raises(SystemExit) as refused:
        main(["--shapes", "granularity", "--quack"])
    message = refused.value.code
    assert isinstance(message, str) and "\n" not in message
    assert message.startswith("--quack needs the quack-kernels package (pip install quack-kernels")
