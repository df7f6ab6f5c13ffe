"""Rotary position embeddings (RoPE) in Megatron's non-interleaved (rotate-half) convention.

The first `rotary_dim = kv_channels * rotary_percent` channels of each head are rotated; the
two halves of that slice are the (real, imaginary) parts of each rotated pair, i.e. channel i
pairs with channel i + rotary_dim / 2 (not with i + 1 as in the interleaved GPT-J layout).
Checkpoints converted from Megatron therefore need no permutation of the QKV weight.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Computes the (cos, sin) tables for given positions; has no parameters or saved buffers."""

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, rotary_base: int = 10000):
        super().__init__()
        self.rotary_dim = int(kv_channels * rotary_percent)
        if self.rotary_dim <= 0 or self.rotary_dim % 2 != 0:
            raise ValueError(
                f"rotary dimension kv_channels * rotary_percent = {kv_channels} * {rotary_percent}"
                f" = {self.rotary_dim} must be a positive even number; change --rotary-percent"
            )
        self.rotary_base = rotary_base

    def forward(
        self, seq_length: int, position_ids: torch.Tensor | None, device: torch.device
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [batch or 1, seq, 1, rotary_dim] in fp32, for broadcasting over heads.

        Positions are `position_ids` [batch, seq] (or [seq]) when given, else 0..seq_length-1.
        """
        # Recomputed every step rather than cached in a buffer: it is cheap, stays out of
        # checkpoints, and survives meta-device construction and dtype casts of the model.
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device)
        inv_freq = 1.0 / (self.rotary_base ** (exponents / self.rotary_dim))
        if position_ids is None:
            position_ids = torch.arange(seq_length, device=device)
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        angles = position_ids.float().unsqueeze(-1) * inv_freq  # [b, s, rotary_dim / 2]
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(2)  # [b, s, 1, rotary_dim]
        return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] channels of x [b, s, heads, head_dim]; pass the rest."""
    rotary_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    x_rot = x_rot * cos.to(x.dtype) + rotate_half(x_rot) * sin.to(x.dtype)
    return torch.cat((x_rot, x_pass), dim=-1)
