"""QuACK's varlen grouped GEMM as the dMoE's grouped product (`QUACK`), opted into by
--moe-grouped-gemm-kernel quack (moe.config.with_grouped_gemm_for).

QuACK (the quack-kernels package: CuTe-DSL kernels for NVIDIA Hopper and Blackwell) is optional:
this module imports everywhere, and quack only inside the ops that run it. It groups by a
variable-length dimension given as cu_seqlens, int32 [E + 1]: 0, then the inclusive cumulative
sums of tokens_per_expert (the `offsets` every grouped product is given, padded by one 0). For
x [N, K] rows grouped by expert and weight [E, K, N'], three torch custom ops:

- moe_quack::grouped_mm, y [N, N'] with y_e = x_e @ weight[e]: gemm(x, weight, cu_seqlens_m=...);
- moe_quack::grouped_mm_input_grad, dx [N, K] with dx_e = dy_e @ weight[e]^T:
  gemm(dy, weight.mT, cu_seqlens_m=...), weight.mT a view (QuACK reads B contiguous along either
  of its last two dims);
- moe_quack::grouped_mm_weight_grad, dw [E, K, N'] with dw[e] = x_e^T @ dy_e:
  gemm(x.t(), dy, cu_seqlens_k=...), x.t() a view contiguous along its first dim as QuACK's
  varlen K needs; zero for an expert without rows (below).

The first carries the autograd formula (through the other two), and each has a fake
implementation (shapes and dtypes only), so torch.compile traces a dMoE on QUACK as one graph
whatever QuACK does inside (QuACK's own custom-op route under compile is not relied on). Rows past
the groups (expert-parallel padding, moe.exchange.fixed_blocks) are in no product: their outputs
and input gradients are left unwritten, as by the Triton kernels (moe.kernels.grouped_gemm).

An expert without rows has a zero weight gradient, written by QuACK itself: its varlen-K kernels
clear a tile's accumulator when its group has no K tile and store it like any other (quack-kernels
0.6.5, gemm_sm90.py and gemm_sm100.py). So no pass over dw zeroes them here: a masked fill
reads and writes the whole gradient, two per layer and micro-batch (docs/benchmark-log.md).
tests/moe/kernels/test_quack_grouped_gemm_gpu.py checks QuACK's zeros on memory left full of NaN
(torch._grouped_mm leaves empty groups unwritten on sm100, pytorch/pytorch#172439).

The ops run QuACK's default config for the GPU's architecture (tuned=False): one compile per
operand layout shared by every shape, where its autotuner (tuned=True) would spend minutes at
each new shape (bench/quack_products.py compares the two).
"""

# No `from __future__ import annotations`: torch.library.custom_op reads the ops' signatures from
# their annotations, and older torch (2.4) does not resolve string annotations.

import importlib
from typing import Optional

import torch
import torch.nn.functional as F

from moe.kernels.grouped_gemm import GroupedGemmBackend

__all__ = ["QUACK", "quack_grouped_mm", "quack_missing", "quack_runs_on"]

# QuACK's default config for the architecture rather than its autotuner (module docstring).
_TUNED = False


def quack_missing() -> Optional[str]:
    """Why quack.gemm_interface does not import here, in one line; None where it does."""
    try:
        importlib.import_module("quack.gemm_interface")
    except Exception as failure:  # ImportError, or a CUDA library the DSL cannot load
        return " ".join(f"{type(failure).__name__}: {failure}".split())
    return None


def quack_runs_on(device: torch.device) -> bool:
    """Whether QuACK's grouped GEMM has kernels for `device`: an NVIDIA GPU of compute
    capability 9.0 or newer (Hopper, Blackwell)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 9


def _gemm():
    from quack.gemm_interface import gemm

    return gemm


def _k_major(rows: torch.Tensor) -> torch.Tensor:
    """`rows` [N, K] contiguous along K, as QuACK's varlen M reads its A (copied only if not)."""
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _varlen_m_product(rows: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor):
    """rows [N, K] grouped by cu_seqlens, each group times its weight [E, K, N'] -> [N, N']."""
    return _gemm()(_k_major(rows), weight, cu_seqlens_m=cu_seqlens, tuned=_TUNED)


@torch.library.custom_op("moe_quack::grouped_mm", mutates_args=())
def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """y_e = x_e @ weight[e]: x [N, K], weight [E, K, N'] -> [N, N']."""
    return _varlen_m_product(x, weight, cu_seqlens)


@_grouped_mm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[2])


@torch.library.custom_op("moe_quack::grouped_mm_input_grad", mutates_args=())
def _grouped_mm_input_grad(
    grad_out: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """dx_e = dy_e @ weight[e]^T: grad_out [N, N'], weight [E, K, N'] -> [N, K]."""
    # The transpose is taken here, a view, so that no compiler pass copies the weight to
    # hand the op a transposed layout.
    return _varlen_m_product(grad_out, weight.mT, cu_seqlens)


@_grouped_mm_input_grad.register_fake
def _(grad_out: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    return grad_out.new_empty(grad_out.shape[0], weight.shape[1])


@torch.library.custom_op("moe_quack::grouped_mm_weight_grad", mutates_args=())
def _grouped_mm_weight_grad(
    x: torch.Tensor, grad_out: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """dw[e] = x_e^T @ dy_e: x [N, K], grad_out [N, N'] -> [E, K, N'], zero for experts
    without rows."""
    # Varlen K reads A = x^T contiguous along its rows (x contiguous along K) and B = dy
    # contiguous along N'.
    return _gemm()(_k_major(x).t(), _k_major(grad_out), cu_seqlens_k=cu_seqlens, tuned=_TUNED)


@_grouped_mm_weight_grad.register_fake
def _(x: torch.Tensor, grad_out: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    return x.new_empty(cu_seqlens.shape[0] - 1, x.shape[1], grad_out.shape[1])


def _setup_context(ctx, inputs, output) -> None:
    x, weight, cu_seqlens = inputs
    ctx.save_for_backward(x, weight, cu_seqlens)


def _backward(ctx, grad_out: torch.Tensor):
    x, weight, cu_seqlens = ctx.saved_tensors
    grad_x = grad_weight = None
    if ctx.needs_input_grad[0]:
        grad_x = _grouped_mm_input_grad(grad_out, weight, cu_seqlens)
    if ctx.needs_input_grad[1]:
        grad_weight = _grouped_mm_weight_grad(x, grad_out, cu_seqlens)
    return grad_x, grad_weight, None


_grouped_mm.register_autograd(_backward, setup_context=_setup_context)


def quack_grouped_mm(
    x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """x [N, K] rows grouped by expert times weight [E, K, N'] (x's dtype) by QuACK, `offsets`
    the int32 inclusive cumulative sums of tokens_per_expert; differentiable w.r.t. x and
    weight (a moe.kernels.grouped_gemm.GroupedMultiply)."""
    return _grouped_mm(x, weight, F.pad(offsets.to(torch.int32), (1, 0)))


QUACK = GroupedGemmBackend(
    "quack (quack-kernels)", compiles_whole=True, fp8_products=False, multiply=quack_grouped_mm
)
