"""FP8 grouped GEMM for the dMoE's experts: rows grouped by expert times each expert's weight,
the three products of training (forward, input gradient, weight gradient) on FP8 operands, and
their reference.

torch._scaled_grouped_mm (CUTLASS on Hopper) multiplies e4m3 operands with float32 scales, one
per row of the left operand and one per column of the right one, accumulates in fp32 and writes
bf16. Its contract decides how each product quantizes (x [N, K] the rows, grouped by
`offsets`; w [E, K, N'] the experts' weights; dy [N, N'] the output gradient):
- forward y = x w_e: x per row; w read column-major (an e4m3 copy of its transpose), per
  (expert, output column);
- input gradient dx = dy w_e^T: dy per row; w as it is (column-major w_e^T), per (expert, row);
- weight gradient dw_e = x_e^T dy_e, the groups along the reduction: x^T row-major per (expert,
  column of x), dy column-major per (expert, column of dy). Its TMA loads need every group to
  start at a multiple of 16 rows, so both are laid out in a copy whose groups are padded with
  zero rows to the next multiple of 16 (at most 15 rows per expert).
The kernel takes e4m3 only: `--fp8-format hybrid`'s e5m2 output gradients are the dense
projections'; the experts' gradients are e4m3 in both formats.

Recipes (megatron.kernels.fp8_linear.Fp8Recipe.scaling): "rowwise" scales as listed above, so an
outlier spoils only its own row (its own expert's, in the weight gradient, whose per-(expert,
column) amax is moe.kernels.group_amax's kernel); "tensorwise" one scale per operand: per
activation or gradient tensor, per expert's weight. Rows after the last group
(moe.exchange.fixed_blocks's padding) are left out of every product, as torch._grouped_mm does.

Under tensor parallelism each rank holds a slice of every expert's ffn channels (`TensorShard`:
w1 split by its output columns, w2 by its input rows); as for the dense projections
(megatron.kernels.fp8_linear.amax_groups) every amax that spans the split dimension is the
maximum over the ranks, so the ranks quantize with one process's scales.

Off the GPU (the CPU tests) the products dequantize the same FP8 operands and multiply them in
fp32 with torch._grouped_mm, so everything but the CUTLASS kernel runs there.
`fp8_grouped_reference` quantizes each expert's operands on their own, without the padded
layout, and multiplies per expert in fp32: the op must match it up to the order of fp32 sums.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.kernels.fp8_linear import (
    Fp8Recipe,
    TensorShard,
    amax_groups,
    dequantized,
    max_over_ranks,
    quantize,
    scaled_cast,
)
from moe.kernels.group_amax import group_column_amax

__all__ = [
    "GROUP_ROW_ALIGNMENT",
    "QuantizedExpertWeight",
    "fp8_grouped_mm",
    "fp8_grouped_reference",
    "quantize_expert_weight",
]

# The weight gradient's groups start at multiples of 16 rows: 16 bytes of e4m3.
GROUP_ROW_ALIGNMENT = 16


class QuantizedExpertWeight(NamedTuple):
    """One expert weight [E, K, N'] in FP8, as the two products that read it want it: the
    forward's column-major copy (stored [E, N', K]) with its inverse scales [E, N'], and the
    input gradient's (stored [E, K, N']) with its inverse scales [E, K]."""

    forward: torch.Tensor
    forward_inverse: torch.Tensor
    backward: torch.Tensor
    backward_inverse: torch.Tensor


def quantize_expert_weight(
    weight: torch.Tensor, recipe: Fp8Recipe, shard: Optional[TensorShard] = None
) -> QuantizedExpertWeight:
    """`weight` [E, K, N'] (split as `shard`) quantized for `fp8_grouped_mm`'s forward and
    input gradient."""
    rowwise = recipe.scaling == "rowwise"
    dtype = recipe.forward_dtype
    forward, forward_inverse = _quantized_experts(
        weight.transpose(1, 2), dtype, rowwise, amax_groups(shard, "forward", rowwise)["w"]
    )
    backward, backward_inverse = _quantized_experts(
        weight, dtype, rowwise, amax_groups(shard, "input gradient", rowwise)["w"]
    )
    return QuantizedExpertWeight(forward, forward_inverse, backward, backward_inverse)


def fp8_grouped_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    recipe: Fp8Recipe,
    quantized: Optional[QuantizedExpertWeight] = None,
    shard: Optional[TensorShard] = None,
) -> torch.Tensor:
    """x [N, K] (rows grouped by expert, `offsets` [E] their int32 inclusive cumulative sums)
    times weight [E, K, N'] per group, in FP8 (module docstring): [N, N'] in bf16, the
    gradients in x's and weight's dtypes. `quantized`: `quantize_expert_weight(weight,
    recipe, shard)` made beforehand (moe.experts keeps it from one weight update to the next,
    for every micro-batch), else the op quantizes `weight` itself. `shard`: how a
    tensor-parallel rank's weight is split."""
    if quantized is None:
        return _Fp8GroupedMm.apply(x, weight, offsets, recipe, shard)
    return _Fp8GroupedMm.apply(x, weight, offsets, recipe, shard, *quantized)


class _Fp8GroupedMm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, offsets, recipe: Fp8Recipe, shard, *quantized):
        quantized = QuantizedExpertWeight(*quantized) if quantized else None
        # The caller's x is saved, not the masked copy: other products save the same tensor.
        ctx.save_for_backward(x, weight, offsets, *(quantized[2:] if quantized else ()))
        x = _grouped_rows_only(x, offsets)
        ctx.recipe, ctx.shard = recipe, shard
        ctx.inputs = 5 + len(quantized or ())
        rowwise = recipe.scaling == "rowwise"
        dtype = recipe.forward_dtype
        groups = amax_groups(shard, "forward", rowwise)
        x_q, x_inverse = _quantized_rows(x, dtype, rowwise, groups["x"])
        if quantized is None:
            w_q, w_inverse = _quantized_experts(weight.transpose(1, 2), dtype, rowwise, groups["w"])
        else:
            w_q, w_inverse = quantized.forward, quantized.forward_inverse
        return _scaled_grouped(x_q, w_q.transpose(1, 2), x_inverse, w_inverse, offsets)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, offsets, *quantized = ctx.saved_tensors
        recipe: Fp8Recipe = ctx.recipe
        rowwise = recipe.scaling == "rowwise"
        dtype = recipe.forward_dtype
        x = _grouped_rows_only(x, offsets)
        grad_output = _grouped_rows_only(grad_output, offsets)
        groups = amax_groups(ctx.shard, "input gradient", rowwise)
        g_q, g_inverse = _quantized_rows(grad_output, dtype, rowwise, groups["dy"])
        if quantized:
            w_q, w_inverse = quantized
        else:
            w_q, w_inverse = _quantized_experts(weight, dtype, rowwise, groups["w"])
        grad_x = _scaled_grouped(g_q, w_q.transpose(1, 2), g_inverse, w_inverse, offsets)
        groups = amax_groups(ctx.shard, "weight gradient", rowwise)
        grad_weight = _weight_gradient(x, grad_output, offsets, dtype, rowwise, groups)
        grads = (grad_x.to(x.dtype), grad_weight.to(weight.dtype))
        return grads + (None,) * (ctx.inputs - 2)


def _grouped_rows_only(rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`rows` with the rows after the last group zeroed: the products leave them out, and
    their values (a product's unwritten output rows, in the backward) must not reach a scale."""
    positions = torch.arange(rows.shape[0], device=rows.device)
    return torch.where((positions < offsets[-1])[:, None], rows, 0).contiguous()


def _quantized_rows(
    rows: torch.Tensor, dtype: torch.dtype, rowwise: bool, group: Optional[dist.ProcessGroup]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """rows [N, C] in `dtype` with their inverse scales [N] (one per row, or one repeated);
    `group`: the amax's (fp8_linear.quantize)."""
    quantized, inverse = quantize(rows, dtype, 1 if rowwise else None, group)
    return quantized, inverse.expand(rows.shape[0], 1).reshape(-1).contiguous()


def _quantized_experts(
    weights: torch.Tensor, dtype: torch.dtype, rowwise: bool, group: Optional[dist.ProcessGroup]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """weights [E, R, C] (a view: any strides) as a contiguous copy in `dtype`, with inverse
    scales [E, R]: per (expert, row) over C, or per expert; each amax the maximum over
    `group`'s ranks when given."""
    amax = weights.detach().abs().float().amax(dim=(2,) if rowwise else (1, 2), keepdim=True)
    amax = max_over_ranks(amax, group)
    quantized, inverse = scaled_cast(weights, dtype, amax)
    experts, rows = weights.shape[0], weights.shape[1]
    inverse = inverse.expand(experts, rows, 1).reshape(experts, rows).contiguous()
    return quantized.contiguous(), inverse


def _weight_gradient(
    x: torch.Tensor,
    grad_output: torch.Tensor,
    offsets: torch.Tensor,
    dtype: torch.dtype,
    rowwise: bool,
    groups: dict,
) -> torch.Tensor:
    """dw [E, K, N'] = x_e^T dy_e for every expert e, on the padded layout (module docstring);
    `groups`: the operands' amax groups (fp8_linear.amax_groups)."""
    rows, experts = x.shape[0], offsets.shape[0]
    offsets = offsets.to(torch.int64)
    starts = F.pad(offsets[:-1], (1, 0))
    padded_counts = (offsets - starts + GROUP_ROW_ALIGNMENT - 1) // GROUP_ROW_ALIGNMENT
    padded_offsets = (padded_counts * GROUP_ROW_ALIGNMENT).cumsum(0)
    padded_starts = F.pad(padded_offsets[:-1], (1, 0))
    # Each row's expert; rows after the last group get `experts`, a group of their own whose
    # scale is zero, which keeps them out.
    positions = torch.arange(rows, device=x.device)
    group = torch.searchsorted(offsets, positions, right=True)
    shift = torch.cat([padded_starts - starts, padded_offsets[-1:] - offsets[-1:]])
    destination = positions + shift[group]
    # Static size (compiles once): at most GROUP_ROW_ALIGNMENT - 1 padding rows per expert, and
    # a multiple of 16 (the row stride of x^T). The last group runs to the end: the rows after
    # it are zeros.
    alignment = GROUP_ROW_ALIGNMENT
    padded_rows = (rows + alignment - 1) // alignment * alignment + alignment * experts
    padded_offsets = torch.cat([padded_offsets[:-1], padded_offsets.new_full((1,), padded_rows)])
    x_q, x_inverse = _quantized_groups(x, offsets, group, experts, dtype, rowwise, groups["x"])
    g_q, g_inverse = _quantized_groups(
        grad_output, offsets, group, experts, dtype, rowwise, groups["dy"]
    )
    x_t = _padded(x_q, destination, padded_rows).t().contiguous()  # [K, rows] row-major
    g = _padded(g_q, destination, padded_rows).t().contiguous().t()  # [rows, N'] column-major
    return _scaled_grouped(
        x_t, g, x_inverse.reshape(-1), g_inverse.reshape(-1), padded_offsets.to(torch.int32)
    )


def _quantized_groups(
    rows: torch.Tensor,
    offsets: torch.Tensor,
    group: torch.Tensor,
    experts: int,
    dtype: torch.dtype,
    rowwise: bool,
    amax_group: Optional[dist.ProcessGroup],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """rows [N, C] in `dtype`, each scaled by its group's scale (`group`: each row's, from
    `offsets`): per (group, column) over the group's rows, or one for the whole tensor (the
    maximum over `amax_group`'s ranks when given); with the inverse scales [E, C] (contiguous)."""
    columns = rows.shape[1]
    if rowwise:
        amax = group_column_amax(rows.detach(), offsets)
    else:
        amax = rows.detach().abs().float().amax()
    amax = max_over_ranks(amax, amax_group)
    if not rowwise:
        amax = amax.expand(experts, columns)
    largest = torch.finfo(dtype).max
    scale = largest / amax.clamp(min=1e-12)
    # The rows after the last group (group `experts`) quantize to zeros.
    scale = torch.cat([scale, scale.new_zeros(1, columns)])
    quantized = (rows.float() * scale[group]).clamp(-largest, largest).to(dtype)
    return quantized, scale[:experts].reciprocal().contiguous()


def _padded(quantized: torch.Tensor, destination: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """quantized [N, C] moved to rows `destination` of a zero [padded_rows, C] (bytes: the
    FP8 dtypes have no index_copy)."""
    buffer = torch.zeros(
        padded_rows, quantized.shape[1], dtype=torch.uint8, device=quantized.device
    )
    buffer.index_copy_(0, destination, quantized.view(torch.uint8))
    return buffer.view(quantized.dtype)


def _scaled_grouped(
    left: torch.Tensor,
    right: torch.Tensor,
    left_inverse: torch.Tensor,
    right_inverse: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """torch._scaled_grouped_mm's product in bf16; off the GPU, the same product of the
    dequantized operands in fp32 (torch._grouped_mm), rounded to bf16."""
    if left.is_cuda:
        return torch._scaled_grouped_mm(
            left, right, left_inverse, right_inverse, offs=offsets, out_dtype=torch.bfloat16
        )
    if right.dim() == 3:  # 2-D x 3-D: scales [N] and [E, N']
        left_fp32 = left.float() * left_inverse[:, None]
        right_fp32 = right.float() * right_inverse[:, None, :]
    else:  # 2-D x 2-D, groups along the reduction: scales [E * K] and [E * N'], group-major
        experts = offsets.shape[0]
        positions = torch.arange(left.shape[1], device=left.device)
        group = torch.searchsorted(offsets.to(torch.int64), positions, right=True)
        group = group.clamp(max=experts - 1)
        left_fp32 = left.float() * left_inverse.view(experts, -1)[group].t()
        right_fp32 = right.float() * right_inverse.view(experts, -1)[group]
    product = torch._grouped_mm(left_fp32.contiguous(), right_fp32.contiguous(), offs=offsets)
    return product.to(torch.bfloat16)


def fp8_grouped_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    grad_output: torch.Tensor,
    offsets: torch.Tensor,
    recipe: Fp8Recipe,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, dx, dw) of `fp8_grouped_mm` for the output gradient `grad_output`, expert by expert
    (module docstring): y and dx for the rows of the groups only (rows after the last group
    are left out, as by the op)."""
    rowwise = recipe.scaling == "rowwise"
    dtype = recipe.forward_dtype
    rows = int(offsets[-1])
    x, grad_output = x[:rows], grad_output[:rows]
    x_dq = dequantized(x, dtype, 1 if rowwise else None)
    g_dq = dequantized(grad_output, dtype, 1 if rowwise else None)
    ys, grad_xs, grad_ws = [], [], []
    bounds = [0] + offsets.tolist()
    for expert, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        w = weight[expert]
        ys.append(x_dq[start:end] @ dequantized(w, dtype, 0 if rowwise else None))
        grad_xs.append(g_dq[start:end] @ dequantized(w, dtype, 1 if rowwise else None).t())
        if end == start:
            grad_ws.append(torch.zeros_like(w, dtype=torch.float32))
            continue
        if rowwise:  # per (expert, column), over the expert's rows
            x_e = dequantized(x[start:end], dtype, 0)
            g_e = dequantized(grad_output[start:end], dtype, 0)
        else:  # the whole x's and dy's scales, as in the other products
            x_e, g_e = x_dq[start:end], g_dq[start:end]
        grad_ws.append(x_e.t() @ g_e)
    y = torch.cat(ys).to(torch.bfloat16)
    grad_x = torch.cat(grad_xs).to(torch.bfloat16).to(x.dtype)
    grad_w = torch.stack(grad_ws).to(torch.bfloat16).to(weight.dtype)
    return y, grad_x, grad_w
