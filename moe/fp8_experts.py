"""Which MoE layers' expert products run in FP8: the MoE's FP8 styles, applied with the dense
projections' FP8 by megatron.parallelize.fp8_projections (through MoEMlpSpec.fp8_styles).

The dMoE's grouped GEMMs take FP8 (moe.kernels.fp8_grouped_gemm) where the run multiplies them
with torch._grouped_mm (NVIDIA Hopper, bf16; moe.kernels.grouped_gemm.choose_backend): the FP8
kernel, torch._scaled_grouped_mm, is that path's FP8 sibling, with the same contract on
offsets and alignment. Everywhere else the experts stay in bf16 and the run says why, once.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.kernels.fp8_linear import Fp8Recipe
from megatron.parallel import parallel_state as ps
from moe.kernels.fp8_grouped_gemm import GROUP_ROW_ALIGNMENT
from moe.kernels.grouped_gemm import BACKENDS
from moe.layers import DroplessMoE, MoE


def dropless_fp8(layer: DroplessMoE, recipe: Fp8Recipe) -> Optional[str]:
    """Give the dMoE layer's grouped GEMMs FP8 products; or why they stay bf16."""
    config = layer.config
    if config.mlp_impl != "grouped":
        return f"--moe-impl {config.mlp_impl} has no FP8 products; the grouped GEMM has"
    if not config.grouped_gemm.fp8_products or not hasattr(torch, "_scaled_grouped_mm"):
        with_fp8 = " or ".join(backend.name for backend in BACKENDS if backend.fp8_products)
        return (
            f"FP8 grouped GEMMs run where the grouped GEMM is {with_fp8} (NVIDIA Hopper, torch "
            f"2.9 or newer); this run's is {config.grouped_gemm.name}"
        )
    experts = layer.experts
    widths = (experts.w1.shape[1], experts.local_ffn_hidden_size)
    if any(width % GROUP_ROW_ALIGNMENT for width in widths):
        return f"the expert widths {widths} are not multiples of {GROUP_ROW_ALIGNMENT}"
    experts.fp8 = recipe
    if ps.get_tensor_model_parallel_world_size() > 1:
        experts.fp8_group = ps.get_tensor_model_parallel_group()
    return None


def capacity_moe_fp8(layer: MoE, recipe: Fp8Recipe) -> Optional[str]:
    """The MoE with capacity keeps its batched expert products in bf16."""
    return "the MoE with capacity's batched expert products have no FP8 form; the dMoE's have"
