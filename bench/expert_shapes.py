"""What bench/grouped_products.py multiplies: the dMoE layers it is run at (`SHAPE_SETS`), the
expert products of one layer's step (`expert_products`) and the dense matmul each is compared
with (`dense_dims`). Plain arithmetic, no GPU: tests/bench/test_grouped_products.py checks it.

For expert weights w1 [E, h, f] (and, for SwiGLU experts, v1 [E, h, f]) and w2 [E, f, h] and
N = tokens * top_k rows sorted by expert, a step's products are the forward x @ w1 (x @ v1),
a @ w2; the input gradients dy @ w2^T, dh @ w1^T (dg @ v1^T); the weight gradients a^T dy,
x^T dh (x^T dg). The dense twin of each has the same M, N, K with one [K, N] weight, so the
same FLOPs: M = N rows for the forward and input gradient (tokens * top_k, not tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from bench.moe_layer import CONFIGS


@dataclass(frozen=True)
class LayerShape:
    """One dMoE layer at one micro-batch: `experts` experts of `ffn` channels on `hidden`, each
    of `tokens` tokens routed to `top_k` of them; `gated`: SwiGLU experts (w1 and v1)."""

    name: str
    hidden: int
    ffn: int
    experts: int
    top_k: int
    tokens: int
    gated: bool = False

    @property
    def rows(self) -> int:
        """The rows the experts multiply: each token once per expert it is routed to."""
        return self.tokens * self.top_k

    @property
    def weight_elements(self) -> int:
        """The elements of one expert weight tensor, all experts together (E * h * f)."""
        return self.experts * self.hidden * self.ffn

    def label(self) -> str:
        """The layer in a table's first column."""
        gate = " SwiGLU" if self.gated else ""
        return (
            f"{self.name}: {self.experts} x{gate} ffn {self.ffn} on {self.hidden}, "
            f"top-{self.top_k}, {self.tokens} tokens"
        )


def granularity_shapes(tokens: int = 65536) -> List[LayerShape]:
    """The dMoE-125M's layer (hidden 768, 64 experts of ffn 3072, top-1) with each expert cut
    into G narrower ones and each token routed to G of them, G = 1, 4, 8: the same active
    FLOPs and the same expert weights at every G. 65,536 tokens: the 125M's micro batch of 64
    sequences of 1,024 on one GPU."""
    return [LayerShape(f"dMoE-125M G={g}", 768, 3072 // g, 64 * g, g, tokens) for g in (1, 4, 8)]


# OLMoE-1B-7B's MoE layer: 64 SwiGLU experts of ffn 1024 on hidden 2048, top-8 (16,384 tokens:
# 131,072 rows, about 3 GiB of operands in bf16).
OLMOE = LayerShape("OLMoE", 2048, 1024, 64, 8, 16384, gated=True)

# --shapes NAME: the layers each name times.
SHAPE_SETS: Dict[str, List[LayerShape]] = {
    "configs": [LayerShape(f"config {index}", *config) for index, config in enumerate(CONFIGS)],
    "granularity": granularity_shapes(),
    "olmoe": [OLMOE],
}


@dataclass(frozen=True)
class ExpertProduct:
    """One grouped product of a layer's step, its operands named as in `operand_shapes`.

    With `weight`: `rows` [N, K] times that expert weight [E, K, N'] (its transpose with
    `transposed`: an input gradient), each expert's rows by its own matrix. Without: a weight
    gradient, rows_e^T @ other_e for each expert e. x [N, h] and a [N, f] stand for every row
    tensor of their width (the output gradient dy is x's shape, dh and dg are a's)."""

    name: str
    rows: str
    weight: Optional[str] = None
    transposed: bool = False
    other: Optional[str] = None


def expert_products(shape: LayerShape) -> List[ExpertProduct]:
    """The products of one step of `shape`'s experts: six, nine for SwiGLU experts."""
    forward = [ExpertProduct("fwd x@w1", "x", "w1")]
    if shape.gated:
        forward.append(ExpertProduct("fwd x@v1", "x", "v1"))
    products = forward + [
        ExpertProduct("fwd a@w2", "a", "w2"),
        ExpertProduct("dgrad dy@w2^T", "x", "w2", transposed=True),
        ExpertProduct("wgrad a^T dy", "a", other="x"),
        ExpertProduct("dgrad dh@w1^T", "a", "w1", transposed=True),
        ExpertProduct("wgrad x^T dh", "x", other="a"),
    ]
    if shape.gated:
        products += [
            ExpertProduct("dgrad dg@v1^T", "a", "v1", transposed=True),
            ExpertProduct("wgrad x^T dg", "x", other="a"),
        ]
    return products


def operand_shapes(shape: LayerShape) -> Dict[str, Tuple[int, ...]]:
    """The row tensors x [N, h] and a [N, f] and the expert weights [E, K, N] by name."""
    rows, hidden, ffn, experts = shape.rows, shape.hidden, shape.ffn, shape.experts
    shapes = {
        "x": (rows, hidden),
        "a": (rows, ffn),
        "w1": (experts, hidden, ffn),
        "w2": (experts, ffn, hidden),
    }
    if shape.gated:
        shapes["v1"] = (experts, hidden, ffn)
    return shapes


def dense_dims(product: ExpertProduct, shape: LayerShape) -> Tuple[int, int, int]:
    """(M, K, N) of the product's dense twin, [M, K] @ [K, N]: for a row product the same rows
    times one expert-sized weight; for a weight gradient rows^T @ other over all the rows."""
    shapes = operand_shapes(shape)
    rows, width = shapes[product.rows]
    if product.weight is None:
        return width, rows, shapes[product.other][1]
    _, reduce, out = shapes[product.weight]
    if product.transposed:
        reduce, out = out, reduce
    if reduce != width:
        raise ValueError(f"{product.name}: rows of width {width} times a weight of {reduce} rows")
    return rows, reduce, out
