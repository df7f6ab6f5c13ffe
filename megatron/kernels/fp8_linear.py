"""FP8 linear products: y = x w^T with its three matmuls on FP8 operands, and their reference.

A training step multiplies three times per linear layer: forward y = x w^T, the input gradient
dx = dy w, the weight gradient dw = dy^T x. Each product here quantizes its two operands to an
FP8 dtype with scales, multiplies them with `torch._scaled_mm` (FP8 tensor cores on Hopper and
MI300, fp32 accumulation) and writes the result in the activations' dtype. The master weight,
its gradient and the activations keep their own dtypes: FP8 exists only inside the products.

Recipes (Megatron-Core's `--fp8-recipe` names):
- "tensorwise": one scale per operand, amax over the whole tensor;
- "rowwise": one scale per row of the left operand and per column of the right one, along the
  reduction dimension's orthogonal axis, so an outlier spoils only its own row.
Formats (`--fp8-format`): "e4m3" quantizes every operand to e4m3; "hybrid" keeps e4m3 for the
forward's operands and uses e5m2, with its wider range, for the output gradient.

Scales are computed from the current amax (dynamic scaling): scale = max_finite / amax, so the
largest magnitude maps onto the dtype's largest finite value; the product is divided back by
both scales. A tensor-parallel layer's product (`TensorShard`) takes the maximum of each amax
over the ranks wherever the amax spans a dimension the ranks split, so every rank quantizes
with the scales one process would use and tensor parallelism changes only the order of sums.
`fp8_linear_reference` quantizes and dequantizes the same way and multiplies in fp32: the op
must match it up to the order of fp32 sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from megatron.parallel.collectives import all_reduce_result

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("tensorwise", "rowwise")

# Below this amax a tensor is treated as zero (its scale stays finite).
_AMAX_FLOOR = 1e-12


@dataclass(frozen=True)
class Fp8Recipe:
    """How the three products quantize: `scaling` one of FP8_RECIPES, `format` one of
    FP8_FORMATS; `fnuz`: the dtypes without negative zero and infinities that MI300X's FP8
    units use (ROCm), chosen by `Fp8Recipe.for_device`."""

    scaling: str = "tensorwise"
    format: str = "e4m3"
    fnuz: bool = False

    def __post_init__(self) -> None:
        if self.scaling not in FP8_RECIPES:
            raise ValueError(f"FP8 recipe {self.scaling!r}: use one of {FP8_RECIPES}")
        if self.format not in FP8_FORMATS:
            raise ValueError(f"FP8 format {self.format!r}: use one of {FP8_FORMATS}")

    @property
    def forward_dtype(self) -> torch.dtype:
        """The dtype of the inputs and weights."""
        return torch.float8_e4m3fnuz if self.fnuz else torch.float8_e4m3fn

    @property
    def gradient_dtype(self) -> torch.dtype:
        """The dtype of the output gradient."""
        if self.format == "e4m3":
            return self.forward_dtype
        return torch.float8_e5m2fnuz if self.fnuz else torch.float8_e5m2


@dataclass(frozen=True)
class TensorShard:
    """A tensor-parallel layer's weight split over `group`: `dim` 0 splits its output features
    (a column-parallel layer), 1 its input features (a row-parallel layer)."""

    dim: int
    group: Optional[dist.ProcessGroup] = None


def quantize(
    tensor: torch.Tensor,
    dtype: torch.dtype,
    rowwise_dim: Optional[int],
    group: Optional[dist.ProcessGroup] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(tensor in `dtype`, the fp32 inverse scale to multiply a product by). One scale for the
    whole 2-D tensor, or with `rowwise_dim` one per slice along the other dimension: amax over
    `rowwise_dim`, kept as a size-1 dimension so that it broadcasts. With `group`, the tensor is
    one rank's part of a tensor split along the amax's dimensions: the amax is the maximum
    over the group's ranks."""
    magnitude = tensor.detach().abs().float()
    if rowwise_dim is None:
        amax = magnitude.amax()
    else:
        amax = magnitude.amax(dim=rowwise_dim, keepdim=True)
    return scaled_cast(tensor, dtype, max_over_ranks(amax, group))


def max_over_ranks(amax: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """`amax`, or with `group` its maximum over the group's ranks (a new tensor, by a
    functional collective: megatron/parallel/collectives.py): the amax of the whole tensor whose
    parts the ranks hold."""
    if group is None:
        return amax
    return all_reduce_result(amax, group, "max")


def scaled_cast(
    tensor: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """`quantize` for a given amax that broadcasts against `tensor`: (tensor * scale in `dtype`,
    1 / scale), scale = max_finite / amax."""
    scale = torch.finfo(dtype).max / amax.clamp(min=_AMAX_FLOOR)
    quantized = (tensor.float() * scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
    return quantized.to(dtype), scale.reciprocal()


def _scaled_product(
    left: torch.Tensor,
    right: torch.Tensor,
    left_dtype: torch.dtype,
    right_dtype: torch.dtype,
    rowwise: bool,
    out_dtype: torch.dtype,
    groups: Tuple[Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]] = (None, None),
) -> torch.Tensor:
    """left [M, K] @ right [K, N] with both quantized (per row of `left` and per column of
    `right` when `rowwise`), accumulated in fp32 by torch._scaled_mm; `groups`: each operand's
    amax group (`quantize`)."""
    left_q, left_inverse = quantize(left, left_dtype, 1 if rowwise else None, groups[0])
    # _scaled_mm wants its left operand row-major (the weight gradient's is a transpose): the
    # copy is of the 1-byte quantized tensor.
    left_q = left_q.contiguous()
    # _scaled_mm wants its right operand column-major: the transpose of a row-major [N, K].
    right_q, right_inverse = quantize(
        right.t().contiguous(), right_dtype, 1 if rowwise else None, groups[1]
    )
    right_inverse = right_inverse.t().contiguous() if rowwise else right_inverse
    # CUDA's rowwise-scaled product writes bf16 only.
    product_dtype = torch.bfloat16 if rowwise and left.is_cuda else out_dtype
    product = torch._scaled_mm(
        left_q,
        right_q.t(),
        scale_a=left_inverse,
        scale_b=right_inverse,
        out_dtype=product_dtype,
    )
    return product.to(out_dtype)


# The three products' operands and the weight dimension each sums over: forward y = x w^T over
# the input features, input gradient dx = dy w over the output features, weight gradient
# dw = dy^T x over the tokens (which tensor parallelism never splits).
_OPERANDS = {"forward": ("x", "w"), "input gradient": ("dy", "w"), "weight gradient": ("dy", "x")}
_SUMMED_WEIGHT_DIM = {"forward": 1, "input gradient": 0, "weight gradient": None}


def amax_groups(
    shard: Optional[TensorShard], product: str, rowwise: bool
) -> Dict[str, Optional[dist.ProcessGroup]]:
    """{operand: its amax group} for `product` ("forward", "input gradient" or "weight
    gradient") of a layer split as `shard`, operands named "x", "dy" and "w": the group where
    the operand is one rank's part along a dimension its amax spans. A rowwise amax spans the
    summed dimension: both operands where the product sums over the split one. A per-tensor
    amax spans all: the weight always, x where the input features are split, dy where the
    output features are."""
    operands = _OPERANDS[product]
    if shard is None:
        return dict.fromkeys(operands)
    if rowwise:
        summed_split = _SUMMED_WEIGHT_DIM[product] == shard.dim
        return dict.fromkeys(operands, shard.group if summed_split else None)
    split = {"w": True, "x": shard.dim == 1, "dy": shard.dim == 0}
    return {operand: shard.group if split[operand] else None for operand in operands}


def _groups(shard: Optional[TensorShard], product: str, rowwise: bool) -> Tuple:
    """`amax_groups` as (left, right) in the order `_scaled_product` takes the operands."""
    groups = amax_groups(shard, product, rowwise)
    return tuple(groups[operand] for operand in _OPERANDS[product])


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        recipe: Fp8Recipe,
        out_dtype: torch.dtype,
        shard: Optional[TensorShard],
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.shard = recipe, shard
        rowwise = recipe.scaling == "rowwise"
        rows = x.reshape(-1, x.shape[-1])
        forward = recipe.forward_dtype
        groups = _groups(shard, "forward", rowwise)
        y = _scaled_product(rows, weight.t(), forward, forward, rowwise, out_dtype, groups)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, weight = ctx.saved_tensors
        recipe: Fp8Recipe = ctx.recipe
        rowwise = recipe.scaling == "rowwise"
        rows = x.reshape(-1, x.shape[-1])
        grad_rows = grad_output.reshape(-1, grad_output.shape[-1])
        forward, gradient = recipe.forward_dtype, recipe.gradient_dtype
        groups = _groups(ctx.shard, "input gradient", rowwise)
        grad_x = _scaled_product(grad_rows, weight, gradient, forward, rowwise, x.dtype, groups)
        groups = _groups(ctx.shard, "weight gradient", rowwise)
        grad_weight = _scaled_product(
            grad_rows.t(), rows, gradient, forward, rowwise, weight.dtype, groups
        )
        return grad_x.view_as(x), grad_weight, None, None, None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    recipe: Fp8Recipe,
    bias: Optional[torch.Tensor] = None,
    shard: Optional[TensorShard] = None,
) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T (+ bias) with FP8 operands in all three products (the
    module docstring); `shard`: how a tensor-parallel layer's weight is split. The output in
    autocast's dtype where autocast is on (as F.linear's), else in x's; the gradients in x's
    and weight's dtypes."""
    device_type = x.device.type
    out_dtype = x.dtype
    if torch.is_autocast_enabled(device_type):
        out_dtype = torch.get_autocast_dtype(device_type)
        # As autocast casts F.linear's input: the product saves x in the compute dtype for
        # the weight gradient, not an fp32 copy (a norm's output under autocast is fp32).
        x = x.to(out_dtype)
    y = _Fp8Linear.apply(x, weight, recipe, out_dtype, shard)
    return y if bias is None else y + bias.to(out_dtype)


class Fp8Linear(nn.Linear):
    """torch's linear layer whose product is `fp8_linear`: the same parameters (and checkpoint
    keys), so a model moves between FP8 and bf16 runs either way."""

    recipe: Fp8Recipe

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Fp8Recipe) -> Fp8Linear:
        """`linear`'s parameters (shared, not copied) in an Fp8Linear."""
        with torch.device("meta"):
            layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        layer.weight = linear.weight
        layer.bias = linear.bias
        layer.recipe = recipe
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.recipe, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.recipe.scaling}/{self.recipe.format}"


class Fp8Product(nn.Module):
    """A parallel linear layer's local product (megatron.tensor_parallel.layers' `product`
    part, F.linear as built) in FP8, its weight split as `shard`. No parameters."""

    def __init__(self, recipe: Fp8Recipe, shard: Optional[TensorShard] = None) -> None:
        super().__init__()
        self.recipe = recipe
        self.shard = shard

    def forward(
        self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        return fp8_linear(x, weight, self.recipe, bias, self.shard)


def fp8_unsupported(device: torch.device) -> Optional[str]:
    """Why `device` cannot run the FP8 products, or None where it can: NVIDIA GPUs of compute
    capability 8.9 and newer (Ada, Hopper, Blackwell) and AMD MI300 (gfx942) and newer."""
    if device.type != "cuda":
        return (
            f"FP8 products need a GPU with FP8 tensor cores (NVIDIA compute capability 8.9 or "
            f"newer, AMD MI300); this run is on the {device.type.upper()}"
        )
    if torch.version.hip is not None:
        architecture = torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
        if architecture in ("gfx942", "gfx950") or architecture.startswith("gfx12"):
            return None
        return f"this AMD GPU ({architecture}) has no FP8 units; MI300 (gfx942) or newer has"
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        name = torch.cuda.get_device_name(device)
        return (
            f"{name} (compute capability {capability[0]}.{capability[1]}) has no FP8 tensor "
            "cores; they need 8.9 or newer (Ada, Hopper)"
        )
    return None


def recipe_for(device: torch.device, scaling: str, fmt: str) -> Fp8Recipe:
    """The recipe on `device`: MI300X (gfx942) computes in the fnuz variants, every other FP8
    GPU in the OCP ones. The one place the FP8 dtypes depend on the hardware."""
    fnuz = False
    if device.type == "cuda" and torch.version.hip is not None:
        fnuz = torch.cuda.get_device_properties(device).gcnArchName.startswith("gfx942")
    return Fp8Recipe(scaling, fmt, fnuz)


def dequantized(tensor: torch.Tensor, dtype: torch.dtype, rowwise_dim: Optional[int]):
    """`tensor` quantized as `quantize` does and back, in fp32: what the references multiply."""
    quantized, inverse = quantize(tensor, dtype, rowwise_dim)
    return quantized.float() * inverse


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, grad_output: torch.Tensor, recipe: Fp8Recipe
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, dx, dw) of `fp8_linear` for the output gradient `grad_output`, from operands
    quantized and dequantized alike and multiplied in fp32."""
    rowwise = recipe.scaling == "rowwise"
    forward, gradient = recipe.forward_dtype, recipe.gradient_dtype
    rows = x.reshape(-1, x.shape[-1])
    grad_rows = grad_output.reshape(-1, grad_output.shape[-1])

    def product(left, right, left_dtype, right_dtype):
        # Rowwise: per row of the left operand, per column of the right one.
        left_dq = dequantized(left, left_dtype, 1 if rowwise else None)
        right_dq = dequantized(right, right_dtype, 0 if rowwise else None)
        return left_dq @ right_dq

    y = product(rows, weight.t(), forward, forward).to(x.dtype)
    grad_x = product(grad_rows, weight, gradient, forward).to(x.dtype)
    grad_weight = product(grad_rows.t(), rows, gradient, forward).to(weight.dtype)
    return y.view(*x.shape[:-1], weight.shape[0]), grad_x.view_as(x), grad_weight
