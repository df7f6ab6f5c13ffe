"""Model FLOPs per iteration, as Megatron counts them for its TFLOP/s log line."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron.model.attention import num_query_groups

if TYPE_CHECKING:
    from megatron.config import ModelConfig


def num_floating_point_operations(config: ModelConfig, batch_size: int, seq_length: int) -> int:
    """Forward + backward matmul FLOPs for `batch_size` sequences of `seq_length` tokens.

    Equal to Megatron's `num_floating_point_operations` closed form
        12 b s L h^2 [ (1 + g/n + s/h) q/h + (f/h) (3/2 if SwiGLU) + V / (2 L h) ]
    (q = n * kv_channels, g/n = query groups / heads), written here as a sum of the matmuls
    it counts. A matmul of [m, k] x [k, n] is 2mkn FLOPs; backward is twice forward, hence 3x.
    Like Megatron it counts the full s x s attention matmuls (no halving for the causal mask)
    and ignores norms, softmax, activations and the embedding lookup.
    """
    hidden = config.hidden_size
    query_size = config.num_attention_heads * config.kv_channels
    kv_size = num_query_groups(config) * config.kv_channels
    ffn = config.ffn_hidden_size
    fc1_out = 2 * ffn if config.swiglu else ffn

    # Forward FLOPs per token.
    attention_projections = 2 * hidden * (query_size + 2 * kv_size) + 2 * query_size * hidden
    attention_scores_and_context = 2 * seq_length * query_size + 2 * seq_length * query_size
    mlp = 2 * hidden * fc1_out + 2 * ffn * hidden
    per_layer = attention_projections + attention_scores_and_context + mlp
    logits = 2 * hidden * config.padded_vocab_size
    forward_per_token = config.num_layers * per_layer + logits
    moe = config.moe
    if moe is not None:
        # An MoE layer runs top_k expert MLPs per token (gated when mlp_type is glu), plus
        # the router and the optional shared expert, instead of the dense MLP.
        expert_fc1 = 2 * ffn if moe.mlp_type == "glu" else ffn
        expert_mlp = 2 * hidden * expert_fc1 + 2 * ffn * hidden
        moe_mlp = moe.top_k * expert_mlp + 2 * hidden * moe.num_experts
        if moe.shared_expert:
            shared_ffn = moe.shared_expert_ffn_hidden_size or ffn
            shared_fc1 = 2 * shared_ffn if config.swiglu else shared_ffn
            moe_mlp += 2 * hidden * shared_fc1 + 2 * shared_ffn * hidden
        forward_per_token += moe.num_moe_layers(config.num_layers) * (moe_mlp - mlp)
    return 3 * batch_size * seq_length * forward_per_token
