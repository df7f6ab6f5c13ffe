"""Normalization layers: LayerNorm or RMSNorm, picked by `config.normalization`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
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


NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def build_norm(config: ModelConfig) -> nn.Module:
    """The norm named by `config.normalization` over `hidden_size`, with `layernorm_epsilon`."""
    if config.normalization == "LayerNorm":
        # Megatron's LayerNorm always has a bias, whatever --disable-bias-linear says.
        norm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
    elif config.normalization == "RMSNorm":
        norm = RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
    else:
        raise ValueError(
            f"normalization={config.normalization!r} is not supported; "
            f"use one of {NORMALIZATIONS} (--normalization)"
        )
    return norm
