"""Model FLOPs per iteration, as Megatron counts them for its TFLOP/s log line."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron.model.attention import num_query_groups
from megatron.model.mlp import DENSE_MLP, MlpSpec

if TYPE_CHECKING:
    from megatron.config import ModelConfig


def num_floating_point_operations(
    config: ModelConfig, batch_size: int, seq_length: int, mlp_spec: MlpSpec = DENSE_MLP
) -> int:
    """Forward + backward matmul FLOPs for `batch_size` sequences of `seq_length` tokens.

    Equal to Megatron's `num_floating_point_operations` closed form
        12 b s L h^2 [ (1 + g/n + s/h) q/h + (f/h) (3/2 if SwiGLU) + V / (2 L h) ]
    (q = n * kv_channels, g/n = query groups / heads), written here as a sum of the matmuls
    it counts. A matmul of [m, k] x [k, n] is 2mkn FLOPs; backward is twice forward, hence 3x.
    Like Megatron it counts the full s x s attention matmuls (no halving for the causal mask)
    and ignores norms, softmax, activations and the embedding lookup. Each layer's MLP counts
    what `mlp_spec` says it costs (an MoE layer: its top-k experts, router and shared expert).
    """
    hidden = config.hidden_size
    query_size = config.num_attention_heads * config.kv_channels
    kv_size = num_query_groups(config) * config.kv_channels

    # Forward FLOPs per token.
    attention_projections = 2 * hidden * (query_size + 2 * kv_size) + 2 * query_size * hidden
    attention_scores_and_context = 2 * seq_length * query_size + 2 * seq_length * query_size
    attention = attention_projections + attention_scores_and_context
    mlps = sum(
        mlp_spec.forward_flops_per_token(config, layer) for layer in range(config.num_layers)
    )
    logits = 2 * hidden * config.padded_vocab_size
    forward_per_token = config.num_layers * attention + mlps + logits
    return 3 * batch_size * seq_length * forward_per_token
