"""FP8 products for the attention and MLP projections: a step of megatron.parallelize.steps.

With `--fp8-format` (config.numerics.fp8_format) every projection of the attention
(`linear_qkv`, `linear_proj`) and of the dense MLPs (`linear_fc1`, `linear_fc2`, the MoE shared
expert's included) multiplies in FP8 (megatron.kernels.fp8_linear): a torch linear layer becomes
an `Fp8Linear` sharing its parameters, a tensor-parallel layer keeps its layout and takes the FP8
product as its local `product` part, with how its weight is split (the ranks then quantize
with one process's scales). The embedding, the output layer, the norms, the router and the loss
stay as they are. An extension's modules take part through the MLP spec's `fp8_styles` (moe:
the dMoE's grouped expert GEMMs, moe.fp8_experts). Parameters, gradients and optimizer state
keep their dtypes, so a checkpoint moves between FP8 and bf16 runs either way.
"""

from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional

from torch import nn

from megatron.errors import UserError
from megatron.initialize import print_rank_0
from megatron.kernels.fp8_linear import (
    Fp8Linear,
    Fp8Product,
    Fp8Recipe,
    TensorShard,
    fp8_unsupported,
)
from megatron.parallel import parallel_state as ps
from megatron.tensor_parallel import ColumnParallelLinear, RowParallelLinear

PROJECTION_NAMES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# An extension module's FP8 form: applies it, or returns why the module stays as it is.
Fp8Style = Callable[[nn.Module, Fp8Recipe], Optional[str]]


def check_fp8_device(fp8_format: str, device) -> None:
    """Stop a run asking for FP8 on a device without FP8 units: one line, raised as UserError."""
    reason = fp8_unsupported(device)
    if reason is not None:
        raise UserError(f"--fp8-format {fp8_format}: {reason}; train without --fp8-format")


def _tensor_shard(layer: nn.Module) -> Optional[TensorShard]:
    """How a parallel linear layer's weight is split over the tensor-parallel ranks, so that
    its FP8 products quantize with one process's scales; None on one rank."""
    if ps.get_tensor_model_parallel_world_size() == 1:
        return None
    dim = 0 if isinstance(layer, ColumnParallelLinear) else 1
    return TensorShard(dim, ps.get_tensor_model_parallel_group())


def apply_fp8(
    model: nn.Module, recipe: Fp8Recipe, styles: Optional[Mapping[type, Fp8Style]] = None
) -> nn.Module:
    """Give every projection of `model` (module docstring) FP8 products, and every module whose
    type has one of `styles` (the MLP spec's, MlpSpec.fp8_styles) its FP8 form; prints once
    each reason a style gives for leaving its modules as they are. Returns `model`."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name not in PROJECTION_NAMES:
                continue
            if isinstance(child, (ColumnParallelLinear, RowParallelLinear)):
                child.product = Fp8Product(recipe, _tensor_shard(child))
            elif type(child) is nn.Linear:
                setattr(module, name, Fp8Linear.from_linear(child, recipe))
    reasons: Dict[str, None] = {}
    for module in list(model.modules()):
        style = (styles or {}).get(type(module))
        reason = style(module, recipe) if style is not None else None
        if reason is not None:
            reasons[f"> FP8: {type(module).__name__} stays in bf16: {reason}"] = None
    for line in reasons:
        print_rank_0(line)
    return model
