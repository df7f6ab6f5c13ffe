"""Grouped GEMM for dropless MoE: rows grouped by expert, each group times its own expert weight.

`grouped_mm(x, weight, tokens_per_expert)` multiplies rows `bins[e-1]:bins[e]` of `x` by
`weight[e]`, where `bins = cumsum(tokens_per_expert)`: the Triton kernels
(moe.kernels.grouped_gemm_kernels, launched here) where `use_triton(...)` says so, else the
pure-PyTorch reference, a loop over experts (megatron.kernels.dispatch).

The dMoE's experts call `grouped_product`, the one part of their data path that differs between
platforms: torch._grouped_mm (CUTLASS, no host sync) where it is fast, else `grouped_mm`, or, asked
for by --moe-grouped-gemm-kernel quack, QuACK's (moe.kernels.quack_grouped_gemm). Which one a run
uses is chosen once, at setup (moe.config.with_grouped_gemm_for, into `MoEConfig.grouped_gemm`): a
`GroupedGemmBackend` record, which the rest of the run asks what it supports (compiling as one
graph, FP8 products) rather than comparing its name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from megatron.kernels.dispatch import TRITON_AVAILABLE, use_triton
from moe.kernels.grouped_gemm_kernels import (
    DEFAULT_TILE_SIZES,
    HOPPER_ROW_TILE_SIZES,
    HOPPER_WEIGHT_GRAD_TILE_SIZES,
    TileSizes,
    default_tile_sizes,
)

if TRITON_AVAILABLE:
    import triton

    from moe.kernels.grouped_gemm_kernels import _grouped_mm_kernel, _grouped_weight_grad_kernel

__all__ = [
    "BACKENDS",
    "DEFAULT_TILE_SIZES",
    "GroupedGemmBackend",
    "GroupedMultiply",
    "HOPPER_ROW_TILE_SIZES",
    "HOPPER_WEIGHT_GRAD_TILE_SIZES",
    "MOE",
    "TORCH",
    "TileSizes",
    "bf16_widths_are_tma_aligned",
    "choose_backend",
    "default_tile_sizes",
    "grouped_mm",
    "grouped_mm_reference",
    "grouped_product",
    "torch_grouped_mm_is_fast_on",
    "torch_has_grouped_mm",
]


_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# torch._grouped_mm's CUTLASS kernel (and QuACK's) uses TMA: every non-unit stride and every
# base pointer must be a multiple of 16 bytes, and it launches one thread per group (fewer than 1024).
_GROUPED_MM_ALIGNMENT_BYTES = 16
_GROUPED_MM_MAX_GROUPS = 1024


def grouped_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    *,
    tile_sizes: Optional[TileSizes] = None,
) -> torch.Tensor:
    """Per-expert matmul of contiguous row groups: `out[bins[e-1]:bins[e]] = x[...] @ weight[e]`.

    x: [N_total, K]; weight: [E, K, N]; tokens_per_expert: integer [E] summing to at most
    N_total. Returns [N_total, N] in x's dtype; differentiable w.r.t. x and weight. Rows past
    the groups (expert-parallel padding, moe.exchange.fixed_blocks) are in no product: the kernels
    leave their outputs and input gradients unwritten (the reference: zeros). `tile_sizes` sets
    the Triton kernels' launch shape (default: `default_tile_sizes`).
    """
    _check_shapes(x, weight, tokens_per_expert)
    return _GroupedMM.apply(x, weight, tokens_per_expert, tile_sizes)


def grouped_mm_reference(
    x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor
) -> torch.Tensor:
    """Pure-PyTorch grouped_mm: a loop of torch.matmul over experts (autograd through torch)."""
    _check_shapes(x, weight, tokens_per_expert)
    row_groups = x.split(_with_rest(tokens_per_expert, x.shape[0]), dim=0)
    outputs = [rows @ weight[expert] for expert, rows in enumerate(row_groups[:-1])]
    outputs.append(x.new_zeros(row_groups[-1].shape[0], weight.shape[2]))
    return torch.cat(outputs, dim=0)


def _with_rest(tokens_per_expert: torch.Tensor, rows: int) -> list:
    """The groups' sizes on the host, then the rows past them."""
    sizes = tokens_per_expert.tolist()
    return sizes + [rows - sum(sizes)]


def _weight_grad_reference(
    x: torch.Tensor, grad_out: torch.Tensor, tokens_per_expert: torch.Tensor
) -> torch.Tensor:
    """dweight[e] = x_e^T @ grad_out_e by a loop over experts; zeros for experts without rows."""
    sizes = _with_rest(tokens_per_expert, x.shape[0])
    x_groups, grad_groups = x.split(sizes, dim=0)[:-1], grad_out.split(sizes, dim=0)[:-1]
    grads = [rows.t() @ grads for rows, grads in zip(x_groups, grad_groups)]
    return torch.stack(grads) if grads else x.new_empty(0, x.shape[1], grad_out.shape[1])


def _check_shapes(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"grouped_mm expects x [N_total, K] and weight [E, K, N]; got x {tuple(x.shape)} "
            f"and weight {tuple(weight.shape)} (moe/kernels/grouped_gemm.py)"
        )
    if tokens_per_expert.dim() != 1 or tokens_per_expert.shape[0] != weight.shape[0]:
        raise ValueError(
            f"grouped_mm expects tokens_per_expert of shape [E={weight.shape[0]}]; got "
            f"{tuple(tokens_per_expert.shape)} (moe/kernels/grouped_gemm.py)"
        )
    if tokens_per_expert.is_floating_point() or tokens_per_expert.is_complex():
        raise ValueError(
            f"grouped_mm expects an integer tokens_per_expert; got {tokens_per_expert.dtype}"
        )
    if x.dtype != weight.dtype:
        raise ValueError(
            f"grouped_mm expects x and weight of one dtype; got {x.dtype} and {weight.dtype}: "
            "cast one of them before the call (moe/kernels/grouped_gemm.py)"
        )


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, tokens_per_expert, tile_sizes):
        x = x.contiguous()
        weight = weight.contiguous()
        tokens_per_expert = tokens_per_expert.to(device=x.device, dtype=torch.int32)
        ctx.save_for_backward(x, weight, tokens_per_expert)
        ctx.tile_sizes = tile_sizes
        return _forward_product(x, weight, tokens_per_expert, tile_sizes)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, tokens_per_expert = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_x = _input_grad(grad_out, weight, tokens_per_expert, ctx.tile_sizes)
        if ctx.needs_input_grad[1]:
            grad_weight = _weight_grad(x, grad_out, weight, tokens_per_expert, ctx.tile_sizes)
        return grad_x, grad_weight, None, None


def _use_kernels(*tensors: torch.Tensor) -> bool:
    """The Triton kernels where the kernel mode says so and they take the dtype, else the
    reference."""
    return use_triton(*tensors) and all(tensor.dtype in _TRITON_DTYPES for tensor in tensors)


def _forward_product(x, weight, tokens_per_expert, tile_sizes):
    if _use_kernels(weight, x):
        return _grouped_mm_triton(
            x, weight, tokens_per_expert, transpose_weight=False, tile_sizes=tile_sizes
        )
    with torch.no_grad():
        return grouped_mm_reference(x, weight, tokens_per_expert)


def _input_grad(grad_out, weight, tokens_per_expert, tile_sizes):
    """grad_x_e = grad_out_e @ weight[e]^T."""
    if _use_kernels(weight, grad_out):
        return _grouped_mm_triton(
            grad_out, weight, tokens_per_expert, transpose_weight=True, tile_sizes=tile_sizes
        )
    return grouped_mm_reference(grad_out, weight.transpose(1, 2), tokens_per_expert)


def _weight_grad(x, grad_out, weight, tokens_per_expert, tile_sizes):
    """grad_weight[e] = x_e^T @ grad_out_e; zero for experts without rows."""
    if _use_kernels(weight, x, grad_out):
        return _weight_grad_triton(x, grad_out, tokens_per_expert, tile_sizes)
    return _weight_grad_reference(x, grad_out, tokens_per_expert)


# --------------------------------------------------------------------------------------------
# The product a dMoE runs: torch._grouped_mm or the op above, chosen once per run
# --------------------------------------------------------------------------------------------

# (x [N, K] grouped by expert, weight [E, K, N'] in x's dtype, tokens_per_expert [E], offsets:
# their int32 inclusive cumulative sums) -> [N, N'].
GroupedMultiply = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class GroupedGemmBackend:
    """A grouped product the dMoE's experts can run on, and what the rest of a run asks of it.

    `name` is what the run's log prints. `compiles_whole`: the product has no host sync and no
    kernel launched from Python, so torch.compile traces the dMoE as one graph
    (moe.training_hooks compiles the MoE model only then). `fp8_products`: an FP8 grouped
    product with its contract on offsets and alignment exists (torch._scaled_grouped_mm,
    moe.kernels.fp8_grouped_gemm), so moe.fp8_experts may give the experts FP8 products on it.
    `multiply` is the product (`GroupedMultiply`). Chosen once per run by `choose_backend`.
    """

    name: str
    compiles_whole: bool
    fp8_products: bool
    multiply: GroupedMultiply


def _torch_grouped_mm(x, weight, tokens_per_expert, offsets):
    """torch._grouped_mm, with its own autograd; without rows `grouped_mm` runs: its weight
    gradient rejects an operand of no rows (pytorch/pytorch#192497)."""
    if x.shape[0] > 0:
        return torch._grouped_mm(x, weight, offs=offsets)
    return grouped_mm(x, weight, tokens_per_expert)


def _moe_grouped_mm(x, weight, tokens_per_expert, offsets):
    """`grouped_mm`: the Triton kernels or the references, as the kernel mode says."""
    return grouped_mm(x, weight, tokens_per_expert)


TORCH = GroupedGemmBackend(
    "torch._grouped_mm", compiles_whole=True, fp8_products=True, multiply=_torch_grouped_mm
)
MOE = GroupedGemmBackend(
    "moe.kernels.grouped_gemm", compiles_whole=False, fp8_products=False, multiply=_moe_grouped_mm
)
# The backends `choose_backend` picks from; QuACK's (moe.kernels.quack_grouped_gemm.QUACK) is
# only ever asked for, by --moe-grouped-gemm-kernel quack (moe.config.with_grouped_gemm_for).
BACKENDS = (TORCH, MOE)


def torch_has_grouped_mm() -> bool:
    """torch._grouped_mm exists from torch 2.8 on (megatron.torch_floors.GROUPED_MM)."""
    return hasattr(torch, "_grouped_mm")


def torch_grouped_mm_is_fast_on(device: torch.device) -> bool:
    """Whether the running torch has torch._grouped_mm (2.8 and newer) with its CUTLASS kernel
    on `device` and it writes every group of the weight gradient: NVIDIA sm90 (Hopper). Elsewhere
    it is missing (older torch) or falls back to copying the offsets to the host and looping over
    torch.mm, a device sync per call, slower than the Triton kernels. On sm100 (Blackwell) it
    leaves the weight gradient of experts without rows unwritten (pytorch/pytorch#172439); on
    ROCm only gfx942/gfx950 builds with CK have a fast path, not detected here. Those GPUs take
    the Triton kernels."""
    if not torch_has_grouped_mm() or torch.version.hip is not None:
        return False
    if device.type != "cuda":
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major == 9


def bf16_widths_are_tma_aligned(widths: Sequence[int]) -> bool:
    """Whether rows of each width in `widths`, in bf16, are whole multiples of the 16 bytes the
    TMA loads of torch._grouped_mm and QuACK need (multiples of 8 elements)."""
    return all(width * 2 % _GROUPED_MM_ALIGNMENT_BYTES == 0 for width in widths)


def choose_backend(
    device: torch.device, dtype: torch.dtype, widths: Sequence[int], num_groups: int, mode: str
) -> GroupedGemmBackend:
    """The grouped product of a run on `device` with rows of `dtype`, chosen once at setup.

    TORCH where torch._grouped_mm is fast (`torch_grouped_mm_is_fast_on`), for bf16 rows, every
    operand width in `widths` a multiple of the 16 bytes its TMA loads need, fewer than 1024
    groups and kernel `mode` "auto"; else MOE, whose op runs the Triton kernels or the
    references as `mode` says. A compiled dMoE is one graph only on TORCH (`compiles_whole`):
    the Triton launches break it (moe.training_hooks)."""
    if (
        mode == "auto"
        and dtype == torch.bfloat16
        and bf16_widths_are_tma_aligned(widths)
        and 0 < num_groups < _GROUPED_MM_MAX_GROUPS
        and torch_grouped_mm_is_fast_on(device)
    ):
        return TORCH
    return MOE


def grouped_product(
    x: torch.Tensor,
    weight: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    offsets: torch.Tensor,
    backend: GroupedGemmBackend,
) -> torch.Tensor:
    """x [N, K] rows grouped by expert (tokens_per_expert [E] of them each; `offsets` their
    int32 inclusive cumulative sums) times weight [E, K, N'] by `backend`'s product (from
    `choose_backend`), the weight cast to x's dtype here because autocast covers neither
    product."""
    return backend.multiply(x, weight.to(x.dtype), tokens_per_expert, offsets)


# --------------------------------------------------------------------------------------------
# Triton launchers (the kernels are in moe.kernels.grouped_gemm_kernels)
# --------------------------------------------------------------------------------------------


def _dot_input_precision(dtype: torch.dtype) -> str:
    """Match torch.matmul: TF32 for fp32 only where torch allows it (NVIDIA only)."""
    if dtype == torch.float32 and torch.version.hip is None:
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    return "ieee"


def _grouped_mm_triton(
    x, weight, tokens_per_expert, *, transpose_weight, tile_sizes=None, out=None
):
    """out_e = x_e @ weight[e] (or @ weight[e]^T) in one launch over all groups; `out` (tests:
    one prefilled to show which rows are never written) defaults to an empty tensor."""
    tile_sizes = tile_sizes or default_tile_sizes(x, weight_grad=False)
    num_experts = weight.shape[0]
    rows = x.shape[0]
    reduce_size = x.shape[1]
    out_cols = weight.shape[1] if transpose_weight else weight.shape[2]
    if out is None:
        out = torch.empty(rows, out_cols, device=x.device, dtype=x.dtype)
    if num_experts == 0 or rows == 0 or out_cols == 0 or reduce_size == 0:
        if reduce_size == 0:
            out.zero_()
        return out
    block_m = tile_sizes.block_m
    row_offsets = _exclusive_cumsum(tokens_per_expert)
    tile_offsets = _exclusive_cumsum((tokens_per_expert + block_m - 1) // block_m)
    stride_be, stride_bk, stride_bn = weight.stride()
    if transpose_weight:
        # weight[e]^T: its reduction index is weight's last dim, its output column the middle one.
        stride_bk, stride_bn = stride_bn, stride_bk
    # Each group wastes at most one partial row tile, so this bounds the tile count without
    # reading tokens_per_expert on the host; the surplus programs find no expert and return.
    row_tiles = triton.cdiv(rows, block_m) + num_experts
    grid = (row_tiles * triton.cdiv(out_cols, tile_sizes.block_n),)
    _grouped_mm_kernel[grid](
        x,
        weight,
        out,
        row_offsets,
        tile_offsets,
        num_experts,
        rows,
        reduce_size,
        out_cols,
        row_tiles,
        x.stride(0),
        x.stride(1),
        stride_be,
        stride_bk,
        stride_bn,
        out.stride(0),
        out.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=tile_sizes.block_n,
        BLOCK_K=tile_sizes.block_k,
        BLOCK_E=max(16, triton.next_power_of_2(num_experts)),
        GROUP_M=tile_sizes.group_m,
        EVEN_K=reduce_size % tile_sizes.block_k == 0,
        EVEN_N=out_cols % tile_sizes.block_n == 0,
        INPUT_PRECISION=_dot_input_precision(x.dtype),
        num_warps=tile_sizes.num_warps,
        num_stages=tile_sizes.num_stages,
    )
    return out


def _weight_grad_triton(x, grad_out, tokens_per_expert, tile_sizes=None):
    """grad_weight[e] = x_e^T @ grad_out_e, one program per (expert, K tile, N tile)."""
    tile_sizes = tile_sizes or default_tile_sizes(x, weight_grad=True)
    num_experts = tokens_per_expert.shape[0]
    in_features, out_features = x.shape[1], grad_out.shape[1]
    grad_weight = torch.empty(
        num_experts, in_features, out_features, device=x.device, dtype=x.dtype
    )
    if grad_weight.numel() == 0:
        return grad_weight
    # Tiles of K play the row role here, tiles of the tokens the reduction: reuse block_m for K
    # and block_k for the tokens so that one TileSizes fits both kernels. The programs of one
    # expert are consecutive, so its rows stay in L2 while its gradient is written.
    grid = (
        num_experts
        * triton.cdiv(in_features, tile_sizes.block_m)
        * triton.cdiv(out_features, tile_sizes.block_n),
    )
    _grouped_weight_grad_kernel[grid](
        x,
        grad_out,
        grad_weight,
        _exclusive_cumsum(tokens_per_expert),
        in_features,
        out_features,
        x.stride(0),
        x.stride(1),
        grad_out.stride(0),
        grad_out.stride(1),
        grad_weight.stride(0),
        grad_weight.stride(1),
        grad_weight.stride(2),
        BLOCK_K=tile_sizes.block_m,
        BLOCK_N=tile_sizes.block_n,
        BLOCK_T=tile_sizes.block_k,
        EVEN_TILES=in_features % tile_sizes.block_m == 0 and out_features % tile_sizes.block_n == 0,
        INPUT_PRECISION=_dot_input_precision(x.dtype),
        num_warps=tile_sizes.num_warps,
        num_stages=tile_sizes.num_stages,
    )
    return grad_weight


def _exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    """[0, c0, c0+c1, ...] as int32 on counts' device (E+1 entries)."""
    offsets = torch.zeros(counts.shape[0] + 1, device=counts.device, dtype=torch.int32)
    torch.cumsum(counts, 0, dtype=torch.int32, out=offsets[1:])
    return offsets
