"""The expert products of one dMoE layer step, each timed alone, next to the dense matmul of the
same FLOPs: where the grouped layer's GEMM time goes (bench/moe_layer.py times the layer).

    python -m bench.grouped_products [--shapes configs granularity olmoe] [--configs 0 1 2 3]
        [--tokens N] [--triton] [--quack [--quack-tuned] [--quack-gather]] [--sweep] [--layouts]

The products and their dense twins are bench/expert_shapes.py's: six per layer (nine for SwiGLU
experts), each dense twin the cuBLAS matmul of the same M, N, K with one [K, N] weight. Each
table row is one product: the dense ms, then torch._grouped_mm's (where torch has it), with
`--triton` our Triton kernels' ms and with `--quack` QuACK's varlen grouped GEMM's
(bench/quack_products.py: the quack-kernels package, Hopper or Blackwell), each also as a
multiple of dense; the last row of a layer is the sum of all its products. `--shapes` picks the
layers: `configs` (bench/moe_layer.py's CONFIGS; `--configs` picks among them), `granularity`
(the dMoE-125M at 65,536 tokens with its experts cut G = 1, 4, 8 ways, top-G), `olmoe` (OLMoE's
SwiGLU layer at 16,384 tokens). Expert loads follow a uniform random routing, as a freshly
initialized router gives.

Before the table, `--quack` checks each QuACK product against torch._grouped_mm (its relative
error printed); one that fails or raises shows "failed" and is not timed. QuACK runs its
default config unless `--quack-tuned` (its autotuner: minutes of compiles on a fresh machine).
`--quack-gather` adds a table for the forward products of x: QuACK with the top-k row copy fused
into its load of the rows (A_idx) against index_select then torch._grouped_mm.

`--sweep` times our Triton kernels at each launch shape of SWEEP_ROW_TILES /
SWEEP_WEIGHT_GRAD_TILES, checks each result against torch._grouped_mm, and prints the fastest
shape per product. `--layouts` times each weight's three products (forward, input gradient,
weight gradient) with the weight stored [E, K, N] (N contiguous) and [E, N, K] (K contiguous):
CUTLASS picks its kernel by operand layout, and the two need not be equally fast at one shape.
`--tokens N` replaces the layers' token count.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import sys
from dataclasses import replace
from typing import Callable, Collection, Dict, List, Optional, Sequence, Tuple

import torch

from bench.expert_shapes import (
    SHAPE_SETS,
    ExpertProduct,
    LayerShape,
    dense_dims,
    expert_products,
    operand_shapes,
)
from bench.quack_products import (
    QUACK,
    checked,
    gathered_lines,
    quack_call,
    quack_version,
    time_cells,
    time_gathered,
    varlen_offsets,
)
from bench.timing import median_ms
from megatron.kernels.dispatch import TRITON_AVAILABLE
from moe.kernels import grouped_gemm as gg
from moe.kernels.grouped_gemm import torch_has_grouped_mm
from moe.kernels.quack_grouped_gemm import quack_missing

GROUPED_MM = "_grouped_mm"
TRITON = "Triton"

# (block_m, block_n, block_k, group_m, num_warps, num_stages) tried by --sweep.
SWEEP_ROW_TILES = [
    (128, 128, 64, 8, 4, 4),
    (128, 128, 64, 8, 8, 3),
    (128, 256, 64, 8, 8, 3),
    (64, 256, 64, 8, 4, 4),
    (128, 64, 64, 8, 4, 4),
    (256, 128, 64, 8, 8, 3),
    (64, 128, 64, 8, 4, 4),
    (128, 128, 64, 16, 8, 4),
]
# For the weight gradient block_m tiles the weight's rows and block_k the tokens.
SWEEP_WEIGHT_GRAD_TILES = [
    (128, 128, 64, 1, 4, 3),
    (128, 128, 64, 1, 8, 4),
    (128, 256, 64, 1, 8, 3),
    (64, 128, 64, 1, 4, 4),
    (128, 128, 32, 1, 4, 4),
    (256, 128, 64, 1, 8, 3),
    (64, 256, 64, 1, 4, 4),
]


def _layout_products(rows_in, rows_out, weight, offsets):
    """Each product of one weight [E, K, N] with it stored as is and stored as [E, N, K]."""
    weight_t = weight.transpose(-2, -1).contiguous()
    mm = functools.partial(torch._grouped_mm, offs=offsets)
    kn = {
        "fwd": functools.partial(mm, rows_in, weight),
        "dgrad": functools.partial(mm, rows_out, weight.transpose(-2, -1)),
        "wgrad": functools.partial(mm, rows_in.t(), rows_out),
    }
    nk = {
        "fwd": functools.partial(mm, rows_in, weight_t.transpose(-2, -1)),
        "dgrad": functools.partial(mm, rows_out, weight_t),
        "wgrad": functools.partial(mm, rows_out.t(), rows_in),  # [E, N, K]
    }
    return kn, nk


def _operands(shape: LayerShape, device="cuda", dtype=torch.bfloat16):
    """(tokens_per_expert, their int32 inclusive cumulative sums, the expert operands by name,
    the dense twins' weights by name)."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    choice = torch.randint(0, shape.experts, (shape.rows,), generator=generator)
    counts = torch.bincount(choice, minlength=shape.experts).to(device)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    tensors = {
        name: torch.randn(size, device=device, dtype=dtype)
        for name, size in operand_shapes(shape).items()
    }
    dense = {
        name: torch.randn(tensor.shape[1:], device=device, dtype=dtype)
        for name, tensor in tensors.items()
        if tensor.dim() == 3
    }
    return counts, offsets, tensors, dense


def grouped_call(product: ExpertProduct, offsets, tensors) -> Callable[[], torch.Tensor]:
    """The product by torch._grouped_mm."""
    rows = tensors[product.rows]
    if product.weight is None:
        return functools.partial(torch._grouped_mm, rows.t(), tensors[product.other], offs=offsets)
    weight = tensors[product.weight]
    weight = weight.transpose(-2, -1) if product.transposed else weight
    return functools.partial(torch._grouped_mm, rows, weight, offs=offsets)


def triton_call(product: ExpertProduct, counts, tensors, tiles=None) -> Callable[[], torch.Tensor]:
    """The product by our Triton kernels (tiles None: default_tile_sizes for the device)."""
    rows = tensors[product.rows]
    if product.weight is None:
        return functools.partial(
            gg._weight_grad_triton, rows, tensors[product.other], counts, tiles
        )
    return functools.partial(
        gg._grouped_mm_triton,
        rows,
        tensors[product.weight],
        counts,
        transpose_weight=product.transposed,
        tile_sizes=tiles,
    )


def dense_call(product: ExpertProduct, tensors, dense) -> Callable[[], torch.Tensor]:
    """The product's dense twin (bench.expert_shapes.dense_dims) by cuBLAS."""
    rows = tensors[product.rows]
    if product.weight is None:
        other = tensors[product.other]
        return lambda: rows.t() @ other
    weight = dense[product.weight]
    weight = weight.t() if product.transposed else weight
    return lambda: rows @ weight


def sweep(shape: LayerShape):
    """[(product, _grouped_mm ms, best Triton ms, best shape, its relative error)]."""
    counts, offsets, tensors, _ = _operands(shape)
    results = []
    for product in expert_products(shape):
        torch_fn = grouped_call(product, offsets, tensors)
        want = torch_fn().float()
        weight_grad = product.weight is None
        shapes = SWEEP_WEIGHT_GRAD_TILES if weight_grad else SWEEP_ROW_TILES
        best = (float("inf"), None, float("nan"))
        for launch in shapes:
            try:
                run = triton_call(product, counts, tensors, gg.TileSizes(*launch))
                got = run().float()
                error = ((got - want).norm() / want.norm()).item()
                ms = median_ms(run) if error < 1e-2 else float("inf")
            except Exception as failure:  # out of shared memory, say: report and go on
                print(f"{product.name} {launch}: {type(failure).__name__}: {failure}"[:300])
                continue
            print(f"  {product.name} {launch}: {ms:.3f} ms, relative error {error:.1e}", flush=True)
            if ms < best[0]:
                best = (ms, ("ptr", *launch), error)
        results.append((product.name, median_ms(torch_fn), *best))
    return results


def quack_failures(shape: LayerShape, tuned: bool) -> List[str]:
    """The names of `shape`'s products whose QuACK result fails its check against
    torch._grouped_mm's or raises (bench.quack_products.checked prints each one's error)."""
    counts, offsets, tensors, _ = _operands(shape)
    cu_seqlens = varlen_offsets(counts)
    failed = []
    for product in expert_products(shape):
        want = grouped_call(product, offsets, tensors)()
        run = quack_call(product, cu_seqlens, tensors, tuned)
        if not checked(f"{QUACK} {product.name} at {shape.label()}", run, want):
            failed.append(product.name)
    return failed


def time_products(
    shape: LayerShape,
    columns: Sequence[str],
    quack_tuned: bool = False,
    quack_failed: Collection[str] = (),
) -> List[Tuple[str, float, Dict[str, float]]]:
    """[(product, dense ms, {column: grouped ms})] for each of `shape`'s products, the grouped
    ones by each of `columns` (GROUPED_MM, TRITON, QUACK); QUACK's NaN (not timed) for the
    products named in `quack_failed`."""
    counts, offsets, tensors, dense = _operands(shape)
    cu_seqlens = varlen_offsets(counts)
    calls = {
        GROUPED_MM: lambda product: grouped_call(product, offsets, tensors),
        TRITON: lambda product: triton_call(product, counts, tensors),
        QUACK: lambda product: quack_call(product, cu_seqlens, tensors, quack_tuned),
    }

    def grouped_ms(column: str, product: ExpertProduct) -> float:
        if column == QUACK and product.name in quack_failed:
            return math.nan
        return median_ms(calls[column](product))

    return [
        (
            product.name,
            median_ms(dense_call(product, tensors, dense)),
            {column: grouped_ms(column, product) for column in columns},
        )
        for product in expert_products(shape)
    ]


def table_header(columns: Sequence[str]) -> List[str]:
    """The markdown header of `table_lines`'s rows."""
    grouped = "".join(f" {column} ms | x dense |" for column in columns)
    aligned = "---:|---:|" * len(columns)
    return [
        f"| layer | product | dense ms | dense TFLOP/s |{grouped}",
        f"|---|---|---:|---:|{aligned}",
    ]


def table_lines(
    shape: LayerShape, results: Sequence[Tuple[str, float, Dict[str, float]]]
) -> List[str]:
    """One markdown row per product (`time_products`'s results), then their sum: each grouped
    time also as a multiple of the dense one, the dense one also in TFLOP/s; a column's sum
    "failed" where one of its products did."""
    products = {product.name: product for product in expert_products(shape)}
    columns = list(results[0][2]) if results else []
    totals = dict.fromkeys(["dense", "flops", *columns], 0.0)
    lines = []
    for name, dense_ms, grouped in results:
        flops = 2 * math.prod(dense_dims(products[name], shape))
        totals["dense"] += dense_ms
        totals["flops"] += flops
        cells = ""
        for column in columns:
            totals[column] += grouped[column]
            cells += time_cells(grouped[column], dense_ms)
        tflops = flops / dense_ms / 1e9
        lines.append(f"| {shape.label()} | {name} | {dense_ms:.3f} | {tflops:.0f} |{cells}")
    cells = "".join(time_cells(totals[column], totals["dense"]) for column in columns)
    weights = len({product.weight for product in products.values()} - {None})
    mib = shape.weight_elements * 2 / 2**20
    everything = f"all {len(results)} ({weights} expert weights of {mib:.0f} MiB in bf16)"
    tflops = totals["flops"] / totals["dense"] / 1e9
    lines.append(
        f"| {shape.label()} | {everything} | {totals['dense']:.3f} | {tflops:.0f} |{cells}"
    )
    return lines


def layouts(shape: LayerShape, repeats=2):
    """[(weight, product, [(ms stored [E, K, N], ms stored [E, N, K])] * repeats, max abs
    difference of the two results)]."""
    _, offsets, tensors, _ = _operands(shape)
    x, a = tensors["x"], tensors["a"]
    results = []
    # (name, row input [M, K], row output gradient [M, N], weight [E, K, N])
    for name, rows_in, rows_out, weight in (
        ("w1", x, a, tensors["w1"]),
        ("w2", a, x, tensors["w2"]),
    ):
        kn, nk = _layout_products(rows_in, rows_out, weight, offsets)
        for product in kn:
            other = nk[product]().float()
            if product == "wgrad":
                other = other.transpose(-2, -1)
            same = (kn[product]().float() - other).abs().max().item()
            times = [(median_ms(kn[product]), median_ms(nk[product])) for _ in range(repeats)]
            results.append((name, product, times, same))
    return results


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line (`argv`: sys.argv's by default)."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.grouped_products", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--shapes",
        nargs="+",
        choices=list(SHAPE_SETS),
        default=["configs"],
        help="the layers to time (module docstring); default: configs",
    )
    parser.add_argument(
        "--configs", type=int, nargs="+", default=None, help="of --shapes configs: these indices"
    )
    parser.add_argument("--triton", action="store_true", help="also our Triton grouped GEMM")
    parser.add_argument("--quack", action="store_true", help="also QuACK's varlen grouped GEMM")
    parser.add_argument(
        "--quack-tuned", action="store_true", help="with --quack: QuACK's autotuner (minutes)"
    )
    parser.add_argument(
        "--quack-gather", action="store_true", help="with --quack: the top-k row copy fused (A_idx)"
    )
    parser.add_argument("--sweep", action="store_true", help="Triton launch shapes, fastest each")
    parser.add_argument("--layouts", action="store_true", help="weights [E,K,N] against [E,N,K]")
    parser.add_argument("--tokens", type=int, default=None, help="instead of each layer's")
    args = parser.parse_args(argv)
    configs = SHAPE_SETS["configs"]
    if args.configs is not None:
        if "configs" not in args.shapes:
            parser.error("--configs picks among --shapes configs; add configs to --shapes")
        if any(not 0 <= index < len(configs) for index in args.configs):
            parser.error(f"--configs {args.configs}: indices run from 0 to {len(configs) - 1}")
    if (args.quack_tuned or args.quack_gather) and not args.quack:
        parser.error("--quack-tuned and --quack-gather say how --quack runs; add --quack")
    if args.quack and (args.sweep or args.layouts):
        parser.error(
            "--quack adds a column to the products table, which --sweep and --layouts replace "
            "with their own; drop one"
        )
    if args.tokens is not None and args.tokens < 1:
        parser.error(f"--tokens must be >= 1, got {args.tokens}")
    return args


def selected_shapes(args: argparse.Namespace) -> List[LayerShape]:
    """The layers the command line asks for, in its order, with --tokens applied."""
    shapes = []
    for name in args.shapes:
        chosen = SHAPE_SETS[name]
        if name == "configs" and args.configs is not None:
            chosen = [chosen[index] for index in args.configs]
        shapes += chosen
    if args.tokens is not None:
        shapes = [replace(shape, tokens=args.tokens) for shape in shapes]
    return shapes


def _refusal(args: argparse.Namespace) -> Optional[str]:
    """Why this machine cannot run the command, in one line; None where it can."""
    if not torch.cuda.is_available():
        return (
            "bench/grouped_products.py needs a CUDA GPU (it times GPU kernels: torch._grouped_mm, "
            "Triton, cuBLAS); torch sees none here"
        )
    needs_grouped_mm = args.sweep or args.layouts or args.quack or not args.triton
    if needs_grouped_mm and not torch_has_grouped_mm():
        return (
            f"torch {torch.__version__} has no torch._grouped_mm (2.8 and newer), which "
            "--sweep, --layouts and the default table time and --quack checks against; time our "
            "kernels alone with --triton"
        )
    if (args.triton or args.sweep) and not TRITON_AVAILABLE:
        return "--triton and --sweep time our Triton kernels, and Triton is not installed here"
    if args.quack and (missing := quack_missing()) is not None:
        return (
            "--quack needs the quack-kernels package (pip install quack-kernels; Hopper or "
            f"Blackwell GPUs): quack.gemm_interface does not import here ({missing})"
        )
    return None


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    shapes = selected_shapes(args)
    refusal = _refusal(args)
    if refusal is not None:
        raise SystemExit(refusal)
    command = " ".join(
        ["python -m bench.grouped_products", *(sys.argv[1:] if argv is None else argv)]
    )
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, median of 20, "
        f"{datetime.date.today()}: {command}"
    )
    if args.layouts:
        print("| layer | weight | product | [E, K, N] ms | [E, N, K] ms | max abs difference |")
        print("|---|---|---|---|---|---:|")
        for shape in shapes:
            for name, product, times, same in layouts(shape):
                kn = " / ".join(f"{t[0]:.3f}" for t in times)
                nk = " / ".join(f"{t[1]:.3f}" for t in times)
                print(
                    f"| {shape.label()} | {name} | {product} | {kn} | {nk} | {same:.1e} |",
                    flush=True,
                )
        return
    if args.sweep:
        tables = [(shape, *row) for shape in shapes for row in sweep(shape)]
        print("| layer | product | _grouped_mm ms | best Triton ms | Triton / torch | shape "
              "(loads, bm, bn, bk, group, warps, stages) | rel. error |")  # fmt: skip
        print("|---|---|---:|---:|---:|---|---:|")
        for shape, name, torch_ms, triton_ms, launch, error in tables:
            print(f"| {shape.label()} | {name} | {torch_ms:.3f} | {triton_ms:.3f} "
                  f"| {triton_ms / torch_ms:.2f} | {launch} | {error:.1e} |")  # fmt: skip
        return
    columns = [GROUPED_MM] if torch_has_grouped_mm() else []
    columns += [TRITON] if args.triton else []
    columns += [QUACK] if args.quack else []
    failed = {}
    if args.quack:
        config = "its autotuner" if args.quack_tuned else "its default config for this GPU"
        print(f"QuACK {quack_version()}, {config} (tuned={args.quack_tuned}), checked first:")
        failed = {shape.label(): quack_failures(shape, args.quack_tuned) for shape in shapes}
    for line in table_header(columns):
        print(line)
    for shape in shapes:
        results = time_products(shape, columns, args.quack_tuned, failed.get(shape.label(), ()))
        for line in table_lines(shape, results):
            print(line, flush=True)
    if args.quack_gather:
        gathered = [
            (shape, *row) for shape in shapes for row in time_gathered(shape, args.quack_tuned)
        ]
        for line in gathered_lines(gathered):
            print(line, flush=True)


if __name__ == "__main__":
    main()
