"""Dense feed-forward block, and `build_mlp`, the one place a layer gets its MLP from.

An MoE layer replaces the dense MLP by being returned from `build_mlp`: it must map
hidden states [b, s, h] -> [b, s, h], and name its output projection weights `linear_fc2`
so that `GPTModel.init_weights` gives them the scaled init.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from megatron.config import ModelConfig


class MLP(nn.Module):
    """h -> ffn -> h: GELU (tanh approximation), or SwiGLU when `config.swiglu`.

    With SwiGLU, linear_fc1 produces 2 * ffn channels [a, b] and the activation is
    silu(a) * b, the layout of Megatron's fused fc1 (a checkpoint's fc1 rows load unchanged).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.swiglu = config.swiglu
        fc1_size = 2 * config.ffn_hidden_size if config.swiglu else config.ffn_hidden_size
        self.linear_fc1 = nn.Linear(config.hidden_size, fc1_size, bias=config.add_bias_linear)
        self.linear_fc2 = nn.Linear(
            config.ffn_hidden_size, config.hidden_size, bias=config.add_bias_linear
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[b, s, h] -> [b, s, h]."""
        intermediate = self.linear_fc1(hidden_states)
        if self.swiglu:
            gate, up = intermediate.chunk(2, dim=-1)
            intermediate = F.silu(gate) * up
        else:
            # tanh approximation: what Megatron's default fused bias-GELU kernel computes.
            intermediate = F.gelu(intermediate, approximate="tanh")
        return self.linear_fc2(intermediate)


def build_mlp(config: ModelConfig, layer_number: int) -> nn.Module:
    """The feed-forward module of layer `layer_number` (0-based, as in `decoder.layers.<n>`).

    Dense for every layer today; the MoE integration decides here which layers get experts.
    """
    del layer_number  # every layer is dense until MoE layers exist
    return MLP(config)
