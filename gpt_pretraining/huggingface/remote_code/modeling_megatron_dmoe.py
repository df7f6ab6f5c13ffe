"""Hugging Face modeling of megatron-dmoe's GPT-2 dMoE, for inference: `MegatronDMoEForCausalLM`.

Loaded with `AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)` from a
directory this project exported; it imports only torch, transformers and its two sibling
files (the configuration, and the router in routing_megatron_dmoe.py). Its parameter names
are the project's checkpoint keys, so an export copies tensors without renaming:

    embedding.word_embeddings.weight                 [vocab, h]
    embedding.position_embeddings.weight             [max_positions, h]
    decoder.layers.N.input_layernorm.{weight,bias}   [h]
    decoder.layers.N.self_attention.linear_qkv.{weight,bias}
        [(heads + 2 groups) * d, h]: per query group, [its query heads | 1 key | 1 value] x d
    decoder.layers.N.self_attention.linear_proj.{weight,bias}   [h, heads * d]
    decoder.layers.N.pre_mlp_layernorm.{weight,bias}  [h]
    MoE layers:   decoder.layers.N.mlp.router.layer.weight [E, h]
                  decoder.layers.N.mlp.router.expert_bias [E] (a buffer; with the expert bias)
                  decoder.layers.N.mlp.experts.{w1, v1 (glu only)} [E, h, e], .w2 [E, e, h]
                  decoder.layers.N.mlp.bias [h] (with add_bias_linear)
    dense layers: decoder.layers.N.mlp.linear_fc1.{weight,bias} [f or 2f, h],
                  decoder.layers.N.mlp.linear_fc2.{weight,bias} [h, f]
    decoder.final_layernorm.{weight,bias}            [h]
    output_layer.weight                              [vocab, h], untied embeddings only

f is ffn_hidden_size, e the experts' size (moe_ffn_hidden_size, else f). The bias entries exist
only with add_bias_linear (the LayerNorms always have one). With tied embeddings
`output_layer.weight` is the word embedding table, tied through transformers'
`_tied_weights_keys`, and stored once.

An MoE layer on tokens x [T, h], routed as the project's router (moe/router.py) routes them:
- logits = x W_router^T [T, E], in the model's dtype (in moe_router_dtype's when it is set);
- scores: the softmax over the experts (in fp32 at least, as autocast runs it) or, with
  moe_router_score "sigmoid", sigmoid(logits) per expert (in the logits' dtype);
- the k = moe_top_k experts with the highest scores (with the expert bias: of scores +
  expert_bias in fp32, the bias only choosing), in descending order: ties to the lower index
  (top-1 by argmax; top-k ranked in fp32 by a stable sort, as the project's top-k kernel);
- weights: the chosen experts' scores (with the bias, still their scores without it), or with
  moe_router_pre_softmax False the softmax of their k logits alone (in fp32); divided by their
  p-norm with normalize_expert_weights = p, then multiplied by moe_router_topk_scaling_factor.
Expert e computes act(x w1[e]) w2[e] (glu: (act(x w1[e]) * (x v1[e])) w2[e]), each assignment's
activations scaled by its weight before w2 (as the project's dMoE does, in fp32), the
moe_top_k outputs summed, plus the layer's bias. No token is dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_megatron_dmoe import MegatronDMoEConfig
from .routing_megatron_dmoe import Router

try:  # transformers 5: initializers that leave already loaded weights alone
    from transformers import initialization as init
except ImportError:  # transformers 4
    from torch.nn import init

# The key-value cache's keyword: `past_key_values` up to transformers 5.23, `cache` from 5.24
# (whose generate() passes only `cache`; the output class takes the old name with a warning).
CACHE_FIELD = (
    "cache"
    if "cache" in {field.name for field in dataclasses.fields(CausalLMOutputWithPast)}
    else "past_key_values"
)

# SDPA's attention mask: None with is_causal (plain causal attention), else a bool
# [batch or 1, 1, query, key] mask of the keys each query may see.
AttentionMask = Tuple[Optional[torch.Tensor], bool]


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (Megatron's and MegaBlocks' activation)."""
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"gelu": gelu_tanh, "silu": F.silu}


class SelfAttention(nn.Module):
    """Causal self-attention with Megatron's fused, per-query-group QKV projection."""

    def __init__(self, config: MegatronDMoEConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_groups = config.num_query_groups
        self.heads_per_group = self.num_heads // self.num_groups
        self.head_dim = config.head_dim
        qkv_size = (self.num_heads + 2 * self.num_groups) * self.head_dim
        bias = config.add_bias_linear
        self.linear_qkv = nn.Linear(config.hidden_size, qkv_size, bias=bias)
        self.linear_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)

    def forward(
        self, x_BSH: torch.Tensor, mask: AttentionMask, cache: Optional[Cache]
    ) -> torch.Tensor:
        """[b, s, h] -> [b, s, h]; appends this step's keys and values to `cache`."""
        batch, seq, _ = x_BSH.shape
        qkv = self.linear_qkv(x_BSH).view(
            batch, seq, self.num_groups, (self.heads_per_group + 2) * self.head_dim
        )
        query, key, value = qkv.split(
            [self.heads_per_group * self.head_dim, self.head_dim, self.head_dim], dim=-1
        )
        query_BNSD = query.reshape(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        key_BGSD, value_BGSD = key.transpose(1, 2), value.transpose(1, 2)
        if cache is not None:
            key_BGSD, value_BGSD = cache.update(key_BGSD, value_BGSD, self.layer_index)
        if self.heads_per_group > 1:
            # Query head i reads group i // heads_per_group (SDPA's enable_gqa needs torch 2.5).
            key_BGSD = key_BGSD.repeat_interleave(self.heads_per_group, dim=1)
            value_BGSD = value_BGSD.repeat_interleave(self.heads_per_group, dim=1)
        attn_mask, is_causal = mask
        context = F.scaled_dot_product_attention(
            query_BNSD, key_BGSD, value_BGSD, attn_mask=attn_mask, is_causal=is_causal
        )
        return self.linear_proj(context.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """The dense layers' MLP: GELU (tanh), or SwiGLU with activation "silu" (linear_fc1 holds
    [gate; up], 2 x ffn rows, the layout of Megatron's fused fc1)."""

    def __init__(self, config: MegatronDMoEConfig) -> None:
        super().__init__()
        self.gated = config.activation == "silu"
        ffn, bias = config.ffn_hidden_size, config.add_bias_linear
        self.linear_fc1 = nn.Linear(config.hidden_size, 2 * ffn if self.gated else ffn, bias=bias)
        self.linear_fc2 = nn.Linear(ffn, config.hidden_size, bias=bias)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        """[b, s, h] -> [b, s, h]."""
        hidden = self.linear_fc1(x_BSH)
        if self.gated:
            gate, up = hidden.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        else:
            hidden = gelu_tanh(hidden)
        return self.linear_fc2(hidden)


class Experts(nn.Module):
    """E bias-free expert MLPs, stored as matmul operands: w1 (and v1) [E, h, f], w2 [E, f, h].

    Two ways to run them, the same function. Up to E (token, expert) assignments (decoding),
    each assignment's expert weights are gathered and applied as one batched product: a few
    launches and no host sync, at the cost of a transient copy no larger than the layer's
    experts. Above that (prefill), the assignments are sorted by expert and each expert that
    got any runs once on its rows: each expert's weights read once, one host sync per layer to
    learn which experts run. Decoding a GPT-2 dMoE 125M (64 experts) in eager mode is bound by
    kernel launches, which the gathered form keeps from growing with the batch.
    """

    def __init__(self, config: MegatronDMoEConfig) -> None:
        super().__init__()
        experts, hidden = config.num_experts, config.hidden_size
        ffn = config.expert_ffn_hidden_size
        self.activation = ACTIVATIONS[config.activation]
        self.w1 = nn.Parameter(torch.empty(experts, hidden, ffn))
        if config.mlp_type == "glu":
            self.v1 = nn.Parameter(torch.empty(experts, hidden, ffn))
        else:
            self.register_parameter("v1", None)
        self.w2 = nn.Parameter(torch.empty(experts, ffn, hidden))

    def forward(
        self, x_TH: torch.Tensor, weights_TK: torch.Tensor, experts_TK: torch.Tensor
    ) -> torch.Tensor:
        """sum_j weights[t, j] * expert_{experts[t, j]}(x[t]): [T, h]."""
        if experts_TK.numel() <= self.w1.shape[0]:
            return self._gathered(x_TH, weights_TK, experts_TK)
        return self._per_expert(x_TH, weights_TK, experts_TK)

    def _mlp(
        self,
        x: torch.Tensor,
        w1: torch.Tensor,
        v1: Optional[torch.Tensor],
        w2: torch.Tensor,
        row_weights: torch.Tensor,
    ) -> torch.Tensor:
        """One expert on rows x [n, h] (weights [h, f]) or one expert per row, x [n, 1, h]
        (weights [n, h, f]); `row_weights` broadcasts against the activations."""
        hidden = self.activation(x @ w1)
        if v1 is not None:
            hidden = hidden * (x @ v1)
        # In fp32, as the project's dMoE scales them: the same rounding in bf16.
        hidden = (hidden.float() * row_weights).to(hidden.dtype)
        return hidden @ w2

    def _gathered(
        self, x_TH: torch.Tensor, weights_TK: torch.Tensor, experts_TK: torch.Tensor
    ) -> torch.Tensor:
        """Each assignment's expert weights gathered and applied as one batched product."""
        num_tokens, top_k = experts_TK.shape
        flat = experts_TK.reshape(-1)
        rows = x_TH.repeat_interleave(top_k, dim=0) if top_k > 1 else x_TH  # row t * k + j
        v1 = self.v1[flat] if self.v1 is not None else None
        out = self._mlp(
            rows.unsqueeze(1), self.w1[flat], v1, self.w2[flat], weights_TK.reshape(-1, 1, 1)
        )
        return out.view(num_tokens, top_k, -1).sum(dim=1)

    def _per_expert(
        self, x_TH: torch.Tensor, weights_TK: torch.Tensor, experts_TK: torch.Tensor
    ) -> torch.Tensor:
        """The assignments sorted by expert (stable), each expert that got any run once on its
        contiguous rows, the rows added back to their tokens."""
        top_k = experts_TK.shape[1]
        flat = experts_TK.reshape(-1)
        order = flat.argsort(stable=True)
        token_of_row = order // top_k
        rows = x_TH.index_select(0, token_of_row)
        row_weights = weights_TK.reshape(-1).index_select(0, order).unsqueeze(1)
        counts = torch.bincount(flat, minlength=self.w1.shape[0]).tolist()  # the host sync
        outputs = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            end = start + count
            v1 = self.v1[expert] if self.v1 is not None else None
            outputs[start:end] = self._mlp(
                rows[start:end], self.w1[expert], v1, self.w2[expert], row_weights[start:end]
            )
            start = end
        return torch.zeros_like(x_TH).index_add_(0, token_of_row, outputs)


class DroplessMoE(nn.Module):
    """MegaBlocks' dMoE layer: router, experts, one output bias. [b, s, h] -> [b, s, h]."""

    def __init__(self, config: MegatronDMoEConfig) -> None:
        super().__init__()
        self.router = Router(config)
        self.experts = Experts(config)
        if config.add_bias_linear:
            self.bias = nn.Parameter(torch.empty(config.hidden_size))
        else:
            self.register_parameter("bias", None)

    def route(self, x_TH: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, experts [T, k] int64) of tokens [T, h] (`Router`)."""
        return self.router(x_TH)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        """[b, s, h] -> [b, s, h]."""
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        weights, experts = self.route(x_TH)
        out = self.experts(x_TH, weights, experts).view_as(x_BSH)
        return out + self.bias if self.bias is not None else out


class TransformerLayer(nn.Module):
    """Pre-LN layer: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: MegatronDMoEConfig, layer_index: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layernorm_epsilon
        self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.self_attention = SelfAttention(config, layer_index)
        self.pre_mlp_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.mlp = DroplessMoE(config) if config.is_moe_layer(layer_index) else MLP(config)

    def forward(
        self, x_BSH: torch.Tensor, mask: AttentionMask, cache: Optional[Cache]
    ) -> torch.Tensor:
        """[b, s, h] -> [b, s, h]."""
        x_BSH = x_BSH + self.self_attention(self.input_layernorm(x_BSH), mask, cache)
        return x_BSH + self.mlp(self.pre_mlp_layernorm(x_BSH))


class Embedding(nn.Module):
    """Word plus learned absolute position embeddings."""

    def __init__(self, config: MegatronDMoEConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """ids [b, s], positions [b or 1, s] -> [b, s, h]."""
        return self.word_embeddings(input_ids) + self.position_embeddings(position_ids)


class TransformerBlock(nn.Module):
    """The layers and the final LayerNorm."""

    def __init__(self, config: MegatronDMoEConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            TransformerLayer(config, index) for index in range(config.num_layers)
        )
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)

    def forward(
        self, x_BSH: torch.Tensor, mask: AttentionMask, cache: Optional[Cache]
    ) -> torch.Tensor:
        """[b, s, h] -> final-normalized [b, s, h]."""
        for layer in self.layers:
            x_BSH = layer(x_BSH, mask, cache)
        return self.final_layernorm(x_BSH)


def positions_and_mask(
    attention_mask: Optional[torch.Tensor], seq: int, past: int, device: torch.device
) -> Tuple[torch.Tensor, AttentionMask]:
    """Position ids [b or 1, seq] and the SDPA mask for `seq` new tokens after `past` cached
    ones; `attention_mask` [b, past + seq] marks real tokens (1) and padding (0), None when
    there is no padding.

    With padding, positions count real tokens only (a left-padded prompt gets the positions it
    has alone) and no query sees a padding key. A padding query would then see nothing, which
    SDPA turns into NaN: it sees itself instead (its output is never used).
    """
    query = torch.arange(past, past + seq, device=device)
    if attention_mask is None:
        if past == 0 or seq == 1:  # a new query sees every key before it, or all of them
            return query.unsqueeze(0), (None, past == 0 and seq > 1)
        keys = torch.arange(past + seq, device=device)
        return query.unsqueeze(0), ((keys <= query.unsqueeze(1))[None, None], False)
    real = attention_mask.bool()
    positions = (real.long().cumsum(dim=-1) - 1).clamp(min=0)[:, -seq:]
    keys = torch.arange(past + seq, device=device)
    visible = (keys <= query.unsqueeze(1))[None, None] & real[:, None, None, :]
    visible = visible | (keys == query.unsqueeze(1))[None, None]
    return positions, (visible, False)


class MegatronDMoEForCausalLM(PreTrainedModel, GenerationMixin):
    """GPT-2 dMoE language model: logits [b, s, vocab], `loss` with `labels`, KV cache for
    `generate` (see the module docstring for the parameter names and the math)."""

    config_class = MegatronDMoEConfig
    # No submodule holds the body; a prefix naming no attribute leaves keys unprefixed.
    base_model_prefix = "model"
    _no_split_modules = ["TransformerLayer"]
    _tied_weights_keys = {"output_layer.weight": "embedding.word_embeddings.weight"}
    # The project keeps the expert bias in fp32 and casts it to the scores' dtype: a model loaded
    # in bf16 then adds it unrounded to fp32 softmax scores, as the project's bf16 runs do.
    _keep_in_fp32_modules_strict = ["expert_bias"]

    def __init__(self, config: MegatronDMoEConfig) -> None:
        super().__init__(config)
        self.embedding = Embedding(config)
        self.decoder = TransformerBlock(config)
        # Always built, so transformers can tie it to the word embeddings (tied models).
        self.output_layer = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Megatron's init for weights a checkpoint does not provide (Linear, Embedding and
        LayerNorm as transformers does them; the experts and MoE bias here)."""
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, Experts):
            for weight in (module.w1, module.v1, module.w2):
                if weight is not None:
                    init.normal_(weight, mean=0.0, std=std)
        elif isinstance(module, DroplessMoE) and module.bias is not None:
            init.zeros_(module.bias)
        elif isinstance(module, Router) and module.expert_bias is not None:
            init.zeros_(module.expert_bias)  # the project's start, before any update

    def get_input_embeddings(self) -> nn.Module:
        """The word embedding table."""
        return self.embedding.word_embeddings

    def set_input_embeddings(self, value: nn.Module) -> None:
        """Replace the word embedding table."""
        self.embedding.word_embeddings = value

    def get_output_embeddings(self) -> nn.Module:
        """The output projection (its weight is the word embedding table when tied)."""
        return self.output_layer

    def set_output_embeddings(self, value: nn.Module) -> None:
        """Replace the output projection."""
        self.output_layer = value

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values: Optional[Cache] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        logits_to_keep: Union[int, torch.Tensor] = 0,
        return_dict: Optional[bool] = None,
        cache: Optional[Cache] = None,
        **kwargs: Any,
    ) -> Union[CausalLMOutputWithPast, Tuple]:
        """Logits [b, s, vocab] for input_ids [b, s] (only the last `logits_to_keep` positions
        when it is > 0), after the tokens already in the key-value cache: `past_key_values`
        or, transformers 5.24's name for it, `cache` (either one).

        `attention_mask` [b, past + s]: 1 for real tokens, 0 for (left) padding; positions
        then count real tokens, unless `position_ids` [b, s] are given. `labels` [b, s] give
        `loss`: the mean cross-entropy of logits[:, :-1] against labels[:, 1:] (-100 ignored),
        in fp32.
        """
        if cache is not None and past_key_values is not None and cache is not past_key_values:
            raise ValueError("pass the key-value cache as `cache` or `past_key_values`, not both")
        past_key_values = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        cache = past_key_values if use_cache else None
        seq = input_ids.shape[1]
        past = cache.get_seq_length() if cache is not None else 0
        if attention_mask is not None and bool(attention_mask.all()):  # one sync a forward
            attention_mask = None  # no padding: plain causal attention, SDPA's fastest
        if attention_mask is None and past + seq > self.config.max_position_embeddings:
            raise ValueError(
                f"{past + seq} tokens exceed max_position_embeddings="
                f"{self.config.max_position_embeddings}: the position table ends there"
            )
        positions, mask = positions_and_mask(attention_mask, seq, past, input_ids.device)
        if position_ids is not None:
            positions = position_ids
        hidden = self.decoder(self.embedding(input_ids, positions), mask, cache)
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        elif not isinstance(logits_to_keep, int):
            hidden = hidden[:, logits_to_keep]
        logits = self.output_layer(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                labels[:, 1:].reshape(-1).to(logits.device),
                ignore_index=-100,
            )
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        if not return_dict:
            output = (logits, cache)
            return (loss, *output) if loss is not None else output
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})
