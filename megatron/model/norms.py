"""Normalization layers: LayerNorm or RMSNorm, picked by `config.normalization`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from megatron.config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm (no mean subtraction, no bias), computed in fp32 like Megatron's."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # fp32 statistics: in bf16 the mean of squares loses too many bits.
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return x.type_as(hidden_states) * self.weight


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm, its weight and bias read in the input's dtype. Under --use-torch-fsdp2
    with --bf16 a layer's norms are gathered in bf16 with its other weights while the residual
    stream stays fp32 (megatron.parallelize.fully_shard): torch's CPU kernel refuses the mix,
    and on GPUs autocast runs the norm in fp32 anyway. Elsewhere the cast changes nothing."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        return F.layer_norm(
            hidden_states, self.normalized_shape, self.weight.to(dtype), self.bias.to(dtype),
            self.eps,
        )  # fmt: skip


NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def build_norm(config: ModelConfig) -> nn.Module:
    """The norm named by `config.normalization` over `hidden_size`, with `layernorm_epsilon`."""
    if config.normalization == "LayerNorm":
        # Megatron's LayerNorm always has a bias, whatever --disable-bias-linear says.
        norm = LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
    elif config.normalization == "RMSNorm":
        norm = RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
    else:
        raise ValueError(
            f"normalization={config.normalization!r} is not supported; "
            f"use one of {NORMALIZATIONS} (--normalization)"
        )
    return norm
