"""A GPTModel's forward with a KV cache: the prefill of left-padded prompts, then one token per
decode step.

Both run the model's own modules (embedding, norms, `SelfAttention.query_key_value`,
`linear_proj`, the layer's MLP or MoE module, the output weight), so a checkpoint decodes with
exactly the weights and math it trained with; only the attention reads its keys and values from
the cache (megatron.inference.kv_cache). The model must be in eval mode (no dropout).

Masking: a query attends the cached slots that hold a real token of its row, up to its own slot
(`key_valid`, causal in the prefill). A padding query attends itself alone: a row of nothing
but masked keys would give NaN in SDPA, and the padding's outputs are never attended.

`decode_step` has fixed shapes and reads no host values (the slot to write and the positions are
device tensors it advances itself), so megatron.inference.cuda_graph can capture it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.inference.kv_cache import KVCache

if TYPE_CHECKING:
    from megatron.model import GPTModel

RotaryCosSin = Optional[Tuple[torch.Tensor, torch.Tensor]]


def prefill(
    model: GPTModel, cache: KVCache, tokens: torch.Tensor, prompt_lengths: torch.Tensor
) -> torch.Tensor:
    """Run left-padded prompts tokens [b, P] (row i's prompt in its last prompt_lengths[i]
    columns) through the model, filling cache slots 0..P-1 and resetting the decode state so
    that the next step writes slot P. Returns the logits of each row's last token [b, vocab]."""
    batch, prompt_length = tokens.shape
    columns = torch.arange(prompt_length, device=tokens.device)
    padding = (prompt_length - prompt_lengths).unsqueeze(1)  # [b, 1]
    real = columns.unsqueeze(0) >= padding  # [b, P]
    # A row's real tokens take positions 0, 1, ...: a padded row reads as the prompt alone.
    positions = (columns.unsqueeze(0) - padding).clamp(min=0)

    cache.key_valid.zero_()
    cache.key_valid[:, :prompt_length] = real
    causal = torch.ones(prompt_length, prompt_length, dtype=torch.bool, device=tokens.device)
    causal = causal.tril()
    diagonal = torch.eye(prompt_length, dtype=torch.bool, device=tokens.device)
    mask = (real.unsqueeze(1) & causal) | diagonal  # [b, P (queries), P (keys)]
    hidden = _forward_layers(model, cache, tokens, positions, mask.unsqueeze(1), None)
    cache.positions.copy_(prompt_lengths)
    cache.write_index.fill_(prompt_length)
    return _logits(model, hidden[:, -1])


def decode_step(model: GPTModel, cache: KVCache, tokens: torch.Tensor) -> torch.Tensor:
    """Feed one token per row, tokens [b, 1], at each row's next position: writes cache slot
    `write_index`, attends every valid slot, advances the state. Returns logits [b, vocab]."""
    cache.key_valid.index_fill_(1, cache.write_index, True)
    # One additive mask for every layer: SDPA would convert a boolean one in each.
    dtype = cache.keys[0].dtype
    zero = torch.zeros((), dtype=dtype, device=tokens.device)
    blocked = torch.full((), float("-inf"), dtype=dtype, device=tokens.device)
    bias = torch.where(cache.key_valid, zero, blocked)[:, None, None, :]  # [b, 1, 1, capacity]
    hidden = _forward_layers(
        model, cache, tokens, cache.positions.unsqueeze(1), bias, cache.write_index
    )
    cache.write_index.add_(1)
    cache.positions.add_(1)
    return _logits(model, hidden[:, -1])


def _forward_layers(
    model: GPTModel,
    cache: KVCache,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    write_index: Optional[torch.Tensor],
) -> torch.Tensor:
    """tokens [b, s] at positions [b, s] -> final-normalized hidden states [b, s, h]; the
    layers' keys and values go to slots 0..s-1 (`write_index` None: the prefill) or to slot
    `write_index` (s = 1), and attention reads slots 0..s-1 or all of them."""
    hidden = model.embedding(tokens, positions)
    rotary: RotaryCosSin = None
    if model.rotary_pos_emb is not None:
        rotary = model.rotary_pos_emb(tokens.shape[1], positions, tokens.device)
    for layer, keys, values in zip(model.decoder.layers, cache.keys, cache.values):
        attention = layer.self_attention
        query, key, value = attention.query_key_value(layer.input_layernorm(hidden), rotary)
        key, value = key.transpose(1, 2), value.transpose(1, 2)  # [b, groups, s, head_dim]
        if write_index is None:
            length = tokens.shape[1]
            keys[:, :, :length].copy_(key)
            values[:, :, :length].copy_(value)
            context = cached_attention(query, keys[:, :, :length], values[:, :, :length], mask)
        else:
            keys.index_copy_(2, write_index, key)
            values.index_copy_(2, write_index, value)
            context = cached_attention(query, keys, values, mask)
        hidden = hidden + attention.linear_proj(context)
        hidden = hidden + layer.mlp(layer.pre_mlp_layernorm(hidden))
    return model.decoder.final_layernorm(hidden)


def cached_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v for query [b, s, heads, d] against keys and values
    [b, groups, L, d]; mask [b, 1, s or 1, L] (boolean: True attends; or additive). Returns
    the context [b, s, heads * d] in the head order of `linear_proj`'s input.

    The heads of a query group share one cached key/value head: they are folded into the
    query rows of their group ([b, groups, heads_per_group * s, d]) rather than repeating the
    cache heads_per_group times.
    """
    batch, seq, heads, head_dim = query.shape
    groups, length = keys.shape[1], keys.shape[2]
    per_group = heads // groups
    query = query.view(batch, seq, groups, per_group, head_dim).permute(0, 2, 3, 1, 4)
    query = query.reshape(batch, groups, per_group * seq, head_dim)
    if per_group > 1 and mask.shape[2] > 1:
        mask = mask.unsqueeze(2).expand(batch, 1, per_group, seq, length)
        mask = mask.reshape(batch, 1, per_group * seq, length)
    context = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask)
    context = context.view(batch, groups, per_group, seq, head_dim).permute(0, 3, 1, 2, 4)
    return context.reshape(batch, seq, heads * head_dim)


def _logits(model: GPTModel, hidden: torch.Tensor) -> torch.Tensor:
    """Final-normalized hidden states [b, h] -> logits [b, vocab]."""
    return F.linear(hidden, model.output_weight())
