"""QuACK's grouped GEMM for bench/grouped_products.py's `--quack` column: each expert product as
one call of quack.gemm_interface.gemm (the quack-kernels package, CuTe-DSL kernels for Hopper and
Blackwell; optional, imported only when asked for). The dMoE runs the same mapping, as torch
custom ops, under --moe-grouped-gemm-kernel quack (moe.kernels.quack_grouped_gemm, whose
`quack_missing` the bench's refusal uses too).

QuACK groups by a variable-length dimension, given as cu_seqlens: int32 [E + 1], 0 then the
inclusive cumulative sums of tokens_per_expert (`varlen_offsets`). For rows [N, K] sorted by
expert (each contiguous along K, as QuACK's varlen M needs):
- forward, rows @ w with w [E, K, N']: gemm(rows, w, cu_seqlens_m=...) -> [N, N'];
- input gradient, rows @ w^T with w [E, N', K]: gemm(rows, w.mT, cu_seqlens_m=...) -> [N, N'],
  w.mT a view (QuACK takes B contiguous along either of its last two dims);
- weight gradient, rows_e^T @ other_e: gemm(rows.t(), other, cu_seqlens_k=...) -> [E, K, N'],
  rows.t() a view contiguous along its first dim, as QuACK's varlen K needs (other contiguous).
`--quack-gather` also passes A_idx (int32, the token of each sorted row) with the unsorted token
rows [T, K], so the top-k row copy happens in the GEMM's load of A (`gathered_calls`).

`tuned=False` runs QuACK's default config for the GPU's architecture: one compile per operand
layout (forward, input gradient, weight gradient, gathered forward), shared by every shape.
`tuned=True` runs its autotuner: every config its pruning keeps (tens per layout on Hopper) is
compiled once and timed at each new shape; minutes on a fresh machine (QuACK caches both on
disk).
"""

from __future__ import annotations

import functools
import importlib
import math
import time
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from bench.expert_shapes import ExpertProduct, LayerShape, expert_products, operand_shapes
from bench.timing import median_ms

QUACK = "QuACK"
# The largest relative Frobenius error of a bf16 product against torch._grouped_mm's that passes.
TOLERANCE = 1e-2


def quack_version() -> str:
    """The imported quack package's version."""
    return importlib.import_module("quack").__version__


def varlen_offsets(counts: torch.Tensor) -> torch.Tensor:
    """QuACK's cu_seqlens for `counts` rows per expert: int32 [E + 1], 0 then the running sums
    (torch._grouped_mm's offs without the leading 0)."""
    return torch.nn.functional.pad(torch.cumsum(counts, 0, dtype=torch.int32), (1, 0))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (Frobenius), in float32."""
    want = want.float()
    return ((got.float() - want).norm() / want.norm()).item()


def checked(name: str, run: Callable[[], torch.Tensor], want: torch.Tensor) -> bool:
    """Whether run() gives `want` within TOLERANCE, said in one printed line with the seconds the
    call took (a first call compiles, or autotunes); a call that raises fails, with its exception
    on that line."""
    start = time.perf_counter()
    try:
        error = relative_error(run(), want)
        seconds = time.perf_counter() - start
        outcome = f"relative error {error:.1e} against torch._grouped_mm ({seconds:.1f} s)"
    except Exception as failure:  # a layout or config the kernels refuse, say: report, go on
        error, outcome = math.inf, " ".join(f"{type(failure).__name__}: {failure}".split())
    passed = error < TOLERANCE  # NaN fails too
    print(f"{name}: {'' if passed else 'failed: '}{outcome}"[:300], flush=True)
    return passed


def quack_call(
    product: ExpertProduct, cu_seqlens: torch.Tensor, tensors: Dict[str, torch.Tensor], tuned: bool
) -> Callable[[], torch.Tensor]:
    """The product by quack.gemm_interface.gemm (module docstring); `cu_seqlens` from
    `varlen_offsets`."""
    from quack.gemm_interface import gemm

    rows = tensors[product.rows]
    if product.weight is None:
        other = tensors[product.other]
        return functools.partial(gemm, rows.t(), other, cu_seqlens_k=cu_seqlens, tuned=tuned)
    weight = tensors[product.weight]
    # A view, not a copy: QuACK reads B contiguous along N or along K.
    weight = weight.mT if product.transposed else weight
    return functools.partial(gemm, rows, weight, cu_seqlens_m=cu_seqlens, tuned=tuned)


def token_routing(shape: LayerShape, device="cuda") -> Tuple[torch.Tensor, torch.Tensor]:
    """(tokens_per_expert, the token of each row once the rows are sorted by expert: int32
    [tokens * top_k]) for bench/grouped_products.py's uniform random routing, row r being one of
    token r // top_k's top_k choices."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    choice = torch.randint(0, shape.experts, (shape.rows,), generator=generator)
    counts = torch.bincount(choice, minlength=shape.experts)
    token_index = torch.argsort(choice, stable=True) // shape.top_k
    return counts.to(device), token_index.to(device=device, dtype=torch.int32)


def _copy_then_grouped_mm(tokens, token_index, weight, offsets) -> torch.Tensor:
    return torch._grouped_mm(tokens.index_select(0, token_index), weight, offs=offsets)


def gathered_calls(
    shape: LayerShape, tuned: bool, device="cuda", dtype=torch.bfloat16
) -> List[Tuple[str, Callable, Callable, Callable]]:
    """[(product, the row copy by index_select, that copy then torch._grouped_mm, QuACK with
    the copy fused by A_idx)] for the products whose rows are the layer's tokens copied once per
    chosen expert: the forward products of x."""
    from quack.gemm_interface import gemm

    counts, token_index = token_routing(shape, device)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    cu_seqlens = varlen_offsets(counts)
    tokens = torch.randn(shape.tokens, shape.hidden, device=device, dtype=dtype)
    sizes = operand_shapes(shape)
    calls = []
    for product in expert_products(shape):
        if product.rows != "x" or product.weight is None or product.transposed:
            continue
        weight = torch.randn(sizes[product.weight], device=device, dtype=dtype)
        calls.append(
            (
                product.name,
                functools.partial(torch.index_select, tokens, 0, token_index),
                functools.partial(_copy_then_grouped_mm, tokens, token_index, weight, offsets),
                functools.partial(
                    gemm, tokens, weight, cu_seqlens_m=cu_seqlens, A_idx=token_index, tuned=tuned
                ),
            )
        )
    return calls


def time_gathered(shape: LayerShape, tuned: bool) -> List[Tuple[str, float, float, float]]:
    """[(product, index_select ms, index_select + _grouped_mm ms, QuACK with A_idx ms)] of
    `gathered_calls`, QuACK's NaN where its result failed the check against torch's."""
    results = []
    for name, copy, torch_way, quack_way in gathered_calls(shape, tuned):
        passed = checked(f"{QUACK} {name} with A_idx at {shape.label()}", quack_way, torch_way())
        quack_ms = median_ms(quack_way) if passed else math.nan
        results.append((name, median_ms(copy), median_ms(torch_way), quack_ms))
    return results


def time_cells(ms: float, baseline_ms: float) -> str:
    """A table's two cells for a time: it and its multiple of the baseline; "failed" for NaN
    (a result that failed its check, not timed)."""
    if math.isnan(ms):
        return " failed | - |"
    return f" {ms:.3f} | {ms / baseline_ms:.2f} |"


def gathered_lines(results: Sequence[Tuple[LayerShape, str, float, float, float]]) -> List[str]:
    """The markdown table of `time_gathered`'s rows, each with its layer."""
    lines = [
        "| layer | product | index_select ms | index_select + _grouped_mm ms "
        "| QuACK with A_idx ms | QuACK / torch |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for shape, name, copy_ms, torch_ms, quack_ms in results:
        quack = time_cells(quack_ms, torch_ms)
        lines.append(f"| {shape.label()} | {name} | {copy_ms:.3f} | {torch_ms:.3f} |{quack}")
    return lines
