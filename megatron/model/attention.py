"""Causal self-attention with a fused QKV projection, grouped-query attention and RoPE.

The fused projection `linear_qkv` is laid out per query group, as Megatron lays it out: its
output channels are num_query_groups blocks of
    [heads_per_group query heads | 1 key head | 1 value head] x kv_channels,
so Megatron checkpoints load without reshuffling and tensor parallelism (applied by
megatron.parallelize.steps) splits the projection along whole groups: each tensor-parallel rank
attends with its num_query_groups / tp groups (and their heads), and `linear_proj` sums the
ranks' partial outputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron.model.rotary import apply_rotary_emb

if TYPE_CHECKING:
    from megatron.config import ModelConfig


def num_query_groups(config: ModelConfig) -> int:
    """Key/value heads: `config.num_query_groups`, where 0 means one per query head (MHA)."""
    groups = config.num_query_groups or config.num_attention_heads
    if config.num_attention_heads % groups != 0:
        raise ValueError(
            f"num_attention_heads={config.num_attention_heads} is not divisible by "
            f"num_query_groups={groups}; pick --num-query-groups dividing the head count"
        )
    return groups


class SelfAttention(nn.Module):
    """Pre-normalized hidden states [b, s, h] -> attention output [b, s, h] (before dropout).

    Under tensor parallelism (megatron.parallelize.tensor_parallelism) the heads are this rank's
    share (`num_heads` and `num_query_groups` count local ones) and the core attention draws its
    dropout from the rank's stream; with sequence parallelism the input and output are this
    rank's sequence shard [b, s / tp, h] and the core attention sees the whole sequence.
    """

    def __init__(self, config: ModelConfig, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.num_heads = config.num_attention_heads
        self.num_query_groups = num_query_groups(config)
        self.heads_per_group = self.num_heads // self.num_query_groups
        self.head_dim = config.kv_channels
        self.core_attention = DotProductAttention(self.heads_per_group, config.attention_dropout)

        query_size = self.num_heads * self.head_dim
        kv_size = self.num_query_groups * self.head_dim
        bias = config.add_bias_linear
        self.linear_qkv = nn.Linear(config.hidden_size, query_size + 2 * kv_size, bias=bias)
        self.linear_proj = nn.Linear(query_size, config.hidden_size, bias=bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary_cos_sin: Tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Attend causally over the sequence; RoPE is applied to q and k when cos/sin are given."""
        query, key, value = self.query_key_value(hidden_states, rotary_cos_sin)
        batch, seq = query.shape[:2]  # the whole sequence, also when the input was a shard
        # SDPA wants [b, heads, s, head_dim].
        query, key, value = (t.transpose(1, 2) for t in (query, key, value))
        context = self.core_attention(query, key, value)
        context = context.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim)
        return self.linear_proj(context)

    def query_key_value(
        self,
        hidden_states: torch.Tensor,
        rotary_cos_sin: Tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pre-normalized hidden states [b, s, h] -> query [b, s, heads, head_dim], key and value
        [b, s, groups, head_dim] (one head per query group), RoPE applied to query and key when
        cos/sin are given. The training forward and the inference KV cache
        (megatron.inference) both attend with these."""
        qkv = self.linear_qkv(hidden_states)
        batch, seq = qkv.shape[:2]
        qkv = qkv.view(
            batch, seq, self.num_query_groups, (self.heads_per_group + 2) * self.head_dim
        )
        query, key, value = qkv.split(
            [self.heads_per_group * self.head_dim, self.head_dim, self.head_dim], dim=-1
        )
        query = query.reshape(batch, seq, self.num_heads, self.head_dim)
        if rotary_cos_sin is not None:
            cos, sin = rotary_cos_sin
            query = apply_rotary_emb(query, cos, sin)
            key = apply_rotary_emb(key, cos, sin)
        return query, key, value


class DotProductAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + causal mask) v over [b, heads, s, head_dim], with attention
    dropout when training; no parameters.

    Selective recompute (`recompute`, switched on by megatron.parallelize.steps for
    recompute_granularity="selective") re-runs it in backward: the s x s attention intermediates
    are the big activations, and re-running only SDPA is cheap next to them. The checkpoint is
    taken inside this module, so a part wrapping it (the per-rank stream of tensor parallelism,
    megatron.tensor_parallel.parts) forks outside the checkpoint, and torch's recompute replays
    the forked stream as the default generator.
    """

    def __init__(self, heads_per_group: int, dropout: float) -> None:
        super().__init__()
        self.heads_per_group = heads_per_group
        self.dropout = dropout
        self.recompute = False

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        if self.recompute and self.training:
            return checkpoint(self.attend, query, key, value, use_reentrant=False)
        return self.attend(query, key, value)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The attention itself (see the class docstring)."""
        if self.heads_per_group > 1:
            # Query head i uses key/value group i // heads_per_group. Expanded here (inside the
            # recomputed region) rather than via SDPA's enable_gqa, which needs torch >= 2.5.
            key = key.repeat_interleave(self.heads_per_group, dim=1)
            value = value.repeat_interleave(self.heads_per_group, dim=1)
        return F.scaled_dot_product_attention(
            query,
            key,
            value,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=True,
        )
