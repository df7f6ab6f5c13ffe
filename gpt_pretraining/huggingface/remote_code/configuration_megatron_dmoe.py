"""Hugging Face configuration of megatron-dmoe's GPT-2 dMoE (`model_type` "megatron_dmoe").

A GPT-2 decoder (learned absolute positions, pre-LayerNorm, linear biases, tied embeddings by
default) whose MLP in some layers is MegaBlocks' dropless MoE: `num_experts` bias-free expert
MLPs of `moe_ffn_hidden_size` channels (None: `ffn_hidden_size`, the dense MLPs' size), a router
picking `moe_top_k` of them, one output bias per layer. `moe_layer_freq` says which
layers, as Megatron-Core's --moe-layer-freq does: an integer N for every N-th layer from layer 0
(0, N, 2N, ...), or a list of one 0 (dense MLP) or 1 (MoE) per layer. Field names follow
Megatron's flags (`--ffn-hidden-size`, `--moe-top-k`, ...); `attribute_map` gives the usual
Hugging Face names too. The experts per
token are `moe_top_k`, not `top_k`: transformers reads a model config's `top_k` as the sampling
parameter of generation.

`activation` is the project's `--swiglu` choice, for every MLP: "gelu" (tanh approximation) for
GELU experts and dense GELU MLPs; "silu" for SiLU experts and dense SwiGLU MLPs (`linear_fc1`
then holds 2 x ffn_hidden_size rows, [gate; up]). `mlp_type` "glu" gates the experts
(act(x w1) * (x v1)).

The routing fields are the project's --moe-router-* flags (modeling_megatron_dmoe's docstring
states the rule): `moe_router_score` "softmax" (over all experts) or "sigmoid" (per expert);
`moe_router_pre_softmax` False weights the chosen experts by the softmax of their logits alone;
`moe_router_topk_scaling_factor` multiplies the weights after the p-norm division;
`moe_router_bias_update_rate` > 0 gives every router an `expert_bias` buffer [E], added to the
scores to choose experts, not to weight them (the rate itself moves the bias in training only;
it is kept so that an import trains on with it); `moe_router_dtype` "fp32" or "fp64" computes
the gate's logits and the routing in that precision (None: the model's dtype, the softmax in
fp32 at least). "fp32" changes the results of a model loaded in a 16-bit dtype only, and there
from the router weights as loaded (rounded to that dtype, where training keeps fp32 masters);
"fp64" changes the last bits at any dtype. The defaults are the routing of exports made before
these fields existed, so their config.json means the same.

This file is copied into exported model directories and imports only transformers.
"""

from __future__ import annotations

import math
from typing import Any, List, Optional, Union

from transformers import PretrainedConfig

MLP_TYPES = ("mlp", "glu")
ACTIVATIONS = ("gelu", "silu")
ROUTER_SCORES = ("softmax", "sigmoid")
ROUTER_DTYPES = ("fp32", "fp64")


class MegatronDMoEConfig(PretrainedConfig):
    """Shape and routing of a GPT-2 dMoE; the defaults are MegaBlocks' dMoE 125M recipe
    (`examples/dmoe_125m_*`) with the GPT-2 vocabulary.

    `num_query_groups` is the number of key/value heads (None: one per query head);
    `normalize_expert_weights` is the p of the p-norm the top-k weights are divided by (None:
    the chosen experts' weights as they are); the `moe_router_*` fields are the module
    docstring's.
    """

    model_type = "megatron_dmoe"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {
        "num_hidden_layers": "num_layers",
        "intermediate_size": "ffn_hidden_size",
        "num_key_value_heads": "num_query_groups",
        "layer_norm_eps": "layernorm_epsilon",
        "num_experts_per_tok": "moe_top_k",
        "num_local_experts": "num_experts",
    }

    def __init__(
        self,
        vocab_size: int = 50257,
        hidden_size: int = 768,
        num_layers: int = 12,
        num_attention_heads: int = 12,
        num_query_groups: Optional[int] = None,
        ffn_hidden_size: int = 3072,
        max_position_embeddings: int = 1024,
        layernorm_epsilon: float = 1e-5,
        add_bias_linear: bool = True,
        tie_word_embeddings: bool = True,
        num_experts: int = 64,
        moe_top_k: int = 1,
        moe_layer_freq: Union[int, List[int]] = 1,
        moe_ffn_hidden_size: Optional[int] = None,
        mlp_type: str = "mlp",
        activation: str = "gelu",
        normalize_expert_weights: Optional[float] = None,
        moe_router_score: str = "softmax",
        moe_router_pre_softmax: bool = True,
        moe_router_topk_scaling_factor: Optional[float] = None,
        moe_router_bias_update_rate: float = 0.0,
        moe_router_dtype: Optional[str] = None,
        initializer_range: float = 0.02,
        use_cache: bool = True,
        bos_token_id: Optional[int] = 50256,
        eos_token_id: Optional[int] = 50256,
        **kwargs: Any,
    ) -> None:
        if mlp_type not in MLP_TYPES:
            raise ValueError(f"mlp_type={mlp_type!r} is not one of {MLP_TYPES}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not one of {ACTIVATIONS}")
        if hidden_size % num_attention_heads != 0:
            raise ValueError(
                f"hidden_size={hidden_size} is not divisible by "
                f"num_attention_heads={num_attention_heads}"
            )
        groups = num_query_groups or num_attention_heads
        if num_attention_heads % groups != 0:
            raise ValueError(
                f"num_attention_heads={num_attention_heads} is not divisible by "
                f"num_query_groups={groups}"
            )
        if "top_k" in kwargs:
            raise ValueError(
                "top_k is transformers' sampling parameter; the experts per token are moe_top_k"
            )
        if not 1 <= moe_top_k <= num_experts:
            raise ValueError(
                f"moe_top_k={moe_top_k} must be between 1 and num_experts={num_experts}"
            )
        if isinstance(moe_layer_freq, int):
            if moe_layer_freq < 1:
                raise ValueError(f"moe_layer_freq={moe_layer_freq} must be >= 1")
        elif len(moe_layer_freq) != num_layers or any(m not in (0, 1) for m in moe_layer_freq):
            raise ValueError(
                f"moe_layer_freq={moe_layer_freq} must be an integer or one 0 or 1 per layer "
                f"(num_layers={num_layers})"
            )
        if moe_ffn_hidden_size is not None and moe_ffn_hidden_size < 1:
            raise ValueError(f"moe_ffn_hidden_size={moe_ffn_hidden_size} must be >= 1")
        _check_routing(
            moe_router_score,
            moe_router_pre_softmax,
            moe_router_topk_scaling_factor,
            moe_router_bias_update_rate,
            moe_router_dtype,
        )
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.num_attention_heads = num_attention_heads
        self.num_query_groups = groups
        self.ffn_hidden_size = ffn_hidden_size
        self.max_position_embeddings = max_position_embeddings
        self.layernorm_epsilon = layernorm_epsilon
        self.add_bias_linear = add_bias_linear
        self.num_experts = num_experts
        self.moe_top_k = moe_top_k
        self.moe_layer_freq = moe_layer_freq
        self.moe_ffn_hidden_size = moe_ffn_hidden_size
        self.mlp_type = mlp_type
        self.activation = activation
        self.normalize_expert_weights = normalize_expert_weights
        self.moe_router_score = moe_router_score
        self.moe_router_pre_softmax = moe_router_pre_softmax
        self.moe_router_topk_scaling_factor = moe_router_topk_scaling_factor
        self.moe_router_bias_update_rate = moe_router_bias_update_rate
        self.moe_router_dtype = moe_router_dtype
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        # Passed on, not set here: the base class's own defaults would overwrite them.
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    @property
    def head_dim(self) -> int:
        """Channels per attention head (Megatron's kv_channels)."""
        return self.hidden_size // self.num_attention_heads

    @property
    def expert_ffn_hidden_size(self) -> int:
        """Each expert's channels: moe_ffn_hidden_size, else the dense MLPs' ffn_hidden_size."""
        if self.moe_ffn_hidden_size is None:
            return self.ffn_hidden_size
        return self.moe_ffn_hidden_size

    @property
    def has_expert_bias(self) -> bool:
        """Whether every router holds `expert_bias` (trained with the expert-bias update)."""
        return self.moe_router_bias_update_rate > 0

    def is_moe_layer(self, layer_index: int) -> bool:
        """Whether layer `layer_index` (0-based) has experts: every moe_layer_freq-th from 0,
        or where the list has a 1."""
        if isinstance(self.moe_layer_freq, int):
            return layer_index % self.moe_layer_freq == 0
        return self.moe_layer_freq[layer_index] == 1


def _check_routing(
    score: str,
    pre_softmax: bool,
    scaling_factor: Optional[float],
    bias_update_rate: float,
    router_dtype: Optional[str],
) -> None:
    """Raise ValueError for routing fields the modeling file has no rule for."""
    if score not in ROUTER_SCORES:
        raise ValueError(f"moe_router_score={score!r} is not one of {ROUTER_SCORES}")
    if not pre_softmax and score != "softmax":
        raise ValueError(
            f"moe_router_pre_softmax=False takes a softmax of the chosen logits, which "
            f"moe_router_score={score!r} does not have"
        )
    # Not `factor <= 0` alone: NaN compares false with everything.
    if scaling_factor is not None and not (math.isfinite(scaling_factor) and scaling_factor > 0):
        raise ValueError(
            f"moe_router_topk_scaling_factor={scaling_factor} must be a finite number > 0"
        )
    if bias_update_rate < 0:
        raise ValueError(f"moe_router_bias_update_rate={bias_update_rate} must be >= 0")
    if router_dtype is not None and router_dtype not in ROUTER_DTYPES:
        raise ValueError(f"moe_router_dtype={router_dtype!r} is not one of {ROUTER_DTYPES}")
