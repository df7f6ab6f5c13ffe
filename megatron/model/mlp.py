"""Dense feed-forward block, and `build_mlp`, the one place a layer gets its MLP from.

An MoE layer (moe.layers) replaces the dense MLP by being returned from `build_mlp` when
`config.moe` is set: it maps hidden states [b, s, h] -> [b, s, h] and gets its Megatron init
from `GPTModel.init_weights` (`init_expert_weights` on its experts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.parallel_layers import column_parallel_linear, row_parallel_linear

if TYPE_CHECKING:
    from megatron.config import ModelConfig


class MLP(nn.Module):
    """h -> ffn -> h: GELU (tanh approximation), or SwiGLU when `config.swiglu`.

    With SwiGLU, linear_fc1 produces 2 * ffn channels [a, b] and the activation is
    silu(a) * b, the layout of Megatron's fused fc1 (a checkpoint's fc1 rows load unchanged).
    Under tensor parallelism each rank holds ffn / tp channels: fc1 is split by output rows
    (with SwiGLU in strided blocks, so a rank's rows are [its a rows; its b rows], Megatron's
    layout) and fc2 by input columns.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.swiglu = config.swiglu
        fc1_size = 2 * config.ffn_hidden_size if config.swiglu else config.ffn_hidden_size
        bias = config.add_bias_linear
        self.linear_fc1 = column_parallel_linear(
            config, config.hidden_size, fc1_size, bias, stride=2 if config.swiglu else 1
        )
        self.linear_fc2 = row_parallel_linear(
            config, config.ffn_hidden_size, config.hidden_size, bias
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

    With `config.moe` set, every `--moe-layer-freq`-th layer (0, freq, 2 freq, ...) gets an
    MoE layer (dMoE or MoE with capacity, per `config.moe.dropless`); the others stay dense.
    """
    if config.moe is not None and config.moe.is_moe_layer(layer_number):
        from moe.layers import build_moe_layer  # moe depends on megatron, not the reverse

        return build_moe_layer(config, config.moe)
    return MLP(config)
