"""FP8 products for the attention and MLP projections: a step of megatron.parallel.parallelize.

With `--fp8-format` (config.numerics.fp8_format) every projection of the attention
(`linear_qkv`, `linear_proj`) and of the dense MLPs (`linear_fc1`, `linear_fc2`, the MoE shared
expert's included) multiplies in FP8 (megatron.kernels.fp8_linear): a torch linear layer becomes
an `Fp8Linear` sharing its parameters, a tensor-parallel layer keeps its layout and takes the FP8
product as its local `product` part. The embedding, the output layer, the norms, the router and
the loss stay as they are. Parameters, gradients and optimizer state keep their dtypes, so a
checkpoint moves between FP8 and bf16 runs either way.
"""

from __future__ import annotations

from torch import nn

from megatron.errors import UserError
from megatron.kernels.fp8_linear import Fp8Linear, Fp8Product, Fp8Recipe, fp8_unsupported
from megatron.tensor_parallel import ColumnParallelLinear, RowParallelLinear

PROJECTION_NAMES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def check_fp8_device(fp8_format: str, device) -> None:
    """Stop a run asking for FP8 on a device without FP8 units: one line, raised as UserError."""
    reason = fp8_unsupported(device)
    if reason is not None:
        raise UserError(f"--fp8-format {fp8_format}: {reason}; train without --fp8-format")


def apply_fp8(model: nn.Module, recipe: Fp8Recipe) -> nn.Module:
    """Give every projection of `model` (module docstring) FP8 products; returns `model`."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name not in PROJECTION_NAMES:
                continue
            if isinstance(child, (ColumnParallelLinear, RowParallelLinear)):
                child.product = Fp8Product(recipe)
            elif type(child) is nn.Linear:
                setattr(module, name, Fp8Linear.from_linear(child, recipe))
    return model
