"""RoPE + RMSNorm + SwiGLU models <-> `LlamaForCausalLM`, and with dMoE SwiGLU experts and
Mixtral's routing <-> `MixtralForCausalLM`.

Both Hugging Face classes rotate the two halves of each head (rotate-half), as
megatron.model.rotary does, so no weight is permuted: the fused QKV projection, laid out per
query group [heads_per_group q | k | v] (megatron.model.attention), splits into q_proj,
k_proj and v_proj; SwiGLU's fc1 [gate; up] into gate_proj and up_proj. Experts store matmul
operands w1, v1 [E, h, f] and w2 [E, f, h] (moe.experts); Mixtral files hold per-expert
linear weights, w1 (gate) and w3 (up) [f, h] and w2 [h, f], the layout of every Mixtral file
on the Hub, which transformers 5 converts on load and vLLM reads. Mixtral's every layer is an
MoE layer, so its `intermediate_size` is the experts' (--moe-ffn-hidden-size); imported, that is
--ffn-hidden-size.

Mixtral renormalizes the top-k router probabilities to sum to 1: this project does that with
`--moe-normalize-expert-weights 1`, and refuses any other routing rather than change it.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from megatron.config import ModelConfig
from megatron.config.layer_pattern import pattern_text
from moe.config import MoEConfig

LLAMA = "LlamaForCausalLM"
MIXTRAL = "MixtralForCausalLM"


def _attention_refusals(model: ModelConfig) -> List[str]:
    problems = []
    if model.position_embedding_type != "rope":
        problems.append(f"--position-embedding-type {model.position_embedding_type}")
    if model.rotary_percent != 1.0:
        problems.append(f"--rotary-percent {model.rotary_percent}")
    if model.normalization != "RMSNorm":
        problems.append(f"--normalization {model.normalization}")
    if not model.swiglu:
        problems.append("GELU MLPs (no --swiglu)")
    return problems


def llama_refusals(model: ModelConfig, moe: Optional[MoEConfig]) -> List[str]:
    """What of this model LlamaForCausalLM cannot express (empty when it maps exactly)."""
    problems = _attention_refusals(model)
    if moe is not None:
        problems.append("MoE layers (--moe-num-experts)")
    return problems


def mixtral_refusals(model: ModelConfig, moe: Optional[MoEConfig]) -> List[str]:
    """What of this model MixtralForCausalLM cannot express (empty when it maps exactly)."""
    problems = _attention_refusals(model)
    if moe is None:
        return problems + ["dense MLPs (no --moe-num-experts)"]
    if model.add_bias_linear:
        problems.append("linear biases (add --disable-bias-linear)")
    if moe.num_moe_layers(model.num_layers) != model.num_layers:
        freq = moe.layer_freq
        shown = freq if isinstance(freq, int) else pattern_text(freq)
        problems.append(f"--moe-layer-freq {shown} (Mixtral's every layer is MoE)")
    if moe.mlp_type != "glu":
        problems.append(f"--mlp-type {moe.mlp_type}")
    # Mixtral's weights: the top-k softmax scores renormalized, which is the softmax over the
    # chosen logits alone.
    renormalized = moe.normalize_expert_weights == 1 or (
        not moe.router_pre_softmax and moe.normalize_expert_weights is None
    )
    if not renormalized:
        problems.append(
            f"--moe-normalize-expert-weights {moe.normalize_expert_weights} (Mixtral "
            "renormalizes the top-k probabilities: train with --moe-normalize-expert-weights 1)"
        )
    if moe.router_score != "softmax":
        problems.append(f"--moe-router-score {moe.router_score}")
    if moe.router_topk_scaling_factor is not None:
        problems.append(f"--moe-router-topk-scaling-factor {moe.router_topk_scaling_factor}")
    if moe.router_bias_update_rate > 0:
        problems.append("--moe-router-bias-update-rate (an expert bias)")
    if moe.shared_expert:
        problems.append(
            "--moe-shared-expert (no Hugging Face class adds an ungated shared expert to "
            "Mixtral's attention and routing)"
        )
    if not moe.dropless:
        problems.append("--moe-dropless off (capacity drops)")
    return problems


def _groups(model: ModelConfig) -> int:
    return model.num_query_groups or model.num_attention_heads


def _decoder_fields(model: ModelConfig, vocab_size: int, eod: int) -> Dict:
    """The config fields LlamaConfig and MixtralConfig share: shape, attention, RoPE, norms."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=_groups(model),
        head_dim=model.kv_channels,
        hidden_act="silu",
        max_position_embeddings=model.max_position_embeddings,
        rms_norm_eps=model.layernorm_epsilon,
        initializer_range=model.init_method_std,
        tie_word_embeddings=not model.untie_embeddings_and_output_weights,
        attention_dropout=model.attention_dropout,
        bos_token_id=eod,
        eos_token_id=eod,
        rope_theta=float(model.rotary_base),
    )


def llama_config(model: ModelConfig, vocab_size: int, eod: int):
    """The LlamaConfig of `model` with `vocab_size` tokens."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        attention_bias=model.add_bias_linear,
        mlp_bias=model.add_bias_linear,
        **_decoder_fields(model, vocab_size, eod),
    )
    config.architectures = [LLAMA]
    return config


def mixtral_config(model: ModelConfig, moe: MoEConfig, vocab_size: int, eod: int):
    """The MixtralConfig of `model` and its experts with `vocab_size` tokens.

    Hugging Face's balancing loss (only with output_router_logits=True) is k times this
    project's per layer, so its coefficient is --moe-loss-weight / k.
    """
    from transformers import MixtralConfig

    fields = _decoder_fields(model, vocab_size, eod)
    # Every layer is an MoE layer (mixtral_refusals): its MLP size is the experts'.
    fields["intermediate_size"] = moe.expert_ffn_hidden_size(model)
    config = MixtralConfig(
        num_local_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        router_aux_loss_coef=moe.loss_weight / moe.top_k,
        router_jitter_noise=0.0,
        sliding_window=None,
        **fields,
    )
    config.architectures = [MIXTRAL]
    return config


def _split_qkv(weight: torch.Tensor, model: ModelConfig):
    """Fused per-group QKV rows -> (q, k, v) rows in head order."""
    groups = _groups(model)
    per_group = model.num_attention_heads // groups
    rest = weight.shape[1:]
    blocks = weight.reshape(groups, per_group + 2, model.kv_channels, *rest)
    query = blocks[:, :per_group].reshape(-1, *rest)
    return (
        query,
        blocks[:, per_group].reshape(-1, *rest),
        blocks[:, per_group + 1].reshape(-1, *rest),
    )


def _fuse_qkv(query, key, value, heads: int, groups: int) -> torch.Tensor:
    rest = query.shape[1:]
    per_group = heads // groups
    query = query.reshape(groups, per_group, -1, *rest)
    key = key.reshape(groups, 1, -1, *rest)
    value = value.reshape(groups, 1, -1, *rest)
    return torch.cat((query, key, value), dim=1).reshape(-1, *rest)


_ATTENTION = ("q_proj", "k_proj", "v_proj")


def to_hf(
    state: Dict[str, torch.Tensor], model: ModelConfig, moe: Optional[MoEConfig], vocab_size: int
) -> Dict[str, torch.Tensor]:
    """This project's single-process state dict -> LlamaForCausalLM's (moe None) or
    MixtralForCausalLM's tensors, vocabulary padding dropped."""
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"][:vocab_size]}
    biases = ("weight", "bias") if model.add_bias_linear else ("weight",)
    f = model.ffn_hidden_size
    for index in range(model.num_layers):
        ours, theirs = f"decoder.layers.{index}.", f"model.layers.{index}."
        out[theirs + "input_layernorm.weight"] = state[ours + "input_layernorm.weight"]
        for kind in biases:
            parts = _split_qkv(state[f"{ours}self_attention.linear_qkv.{kind}"], model)
            for name, part in zip(_ATTENTION, parts):
                out[f"{theirs}self_attn.{name}.{kind}"] = part
            out[f"{theirs}self_attn.o_proj.{kind}"] = state[
                f"{ours}self_attention.linear_proj.{kind}"
            ]
        out[theirs + "post_attention_layernorm.weight"] = state[ours + "pre_mlp_layernorm.weight"]
        if moe is None:
            for kind in biases:
                fc1 = state[f"{ours}mlp.linear_fc1.{kind}"]
                out[f"{theirs}mlp.gate_proj.{kind}"] = fc1[:f]
                out[f"{theirs}mlp.up_proj.{kind}"] = fc1[f:]
                out[f"{theirs}mlp.down_proj.{kind}"] = state[f"{ours}mlp.linear_fc2.{kind}"]
            continue
        moe_prefix = theirs + "block_sparse_moe."
        out[moe_prefix + "gate.weight"] = state[ours + "mlp.router.layer.weight"]
        w1, v1, w2 = (state[f"{ours}mlp.experts.{name}"] for name in ("w1", "v1", "w2"))
        for expert in range(moe.num_experts):
            prefix = f"{moe_prefix}experts.{expert}."
            out[prefix + "w1.weight"] = w1[expert].t()
            out[prefix + "w3.weight"] = v1[expert].t()
            out[prefix + "w2.weight"] = w2[expert].t()
    out["model.norm.weight"] = state["decoder.final_layernorm.weight"]
    if model.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = state["output_layer.weight"][:vocab_size]
    return out


def _rope(config) -> float:
    """rope_theta of a Llama/Mixtral config (transformers 4's attribute or 5's rope_parameters);
    ValueError for a scaled RoPE, which this project does not compute."""
    parameters = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None)
    if scaling:
        parameters.update(scaling)
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"rope type {rope_type!r}: this project computes the default RoPE only; the model "
            "cannot be imported exactly"
        )
    theta = parameters.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None or float(theta) != int(theta):
        raise ValueError(f"rope_theta={theta!r}: --rotary-base takes an integer")
    return int(theta)


def model_flags(config, moe: bool) -> List[str]:
    """pretrain_gpt.py's model flags for a LlamaConfig (moe False) or MixtralConfig."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim * config.num_attention_heads != config.hidden_size:
        raise ValueError(
            f"head_dim={head_dim} x num_attention_heads={config.num_attention_heads} != "
            f"hidden_size={config.hidden_size}: this project's heads split the hidden size"
        )
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r}: this project's SwiGLU uses silu")
    flags = [
        "--num-layers", str(config.num_hidden_layers), "--hidden-size", str(config.hidden_size),
        "--num-attention-heads", str(config.num_attention_heads),
        "--ffn-hidden-size", str(config.intermediate_size),
        "--max-position-embeddings", str(config.max_position_embeddings),
        "--seq-length", str(min(config.max_position_embeddings, 4096)),
        "--position-embedding-type", "rope", "--rotary-base", str(_rope(config)),
        "--normalization", "RMSNorm", "--layernorm-epsilon", repr(config.rms_norm_eps),
        "--swiglu", "--hidden-dropout", "0.0",
        "--attention-dropout", repr(float(getattr(config, "attention_dropout", 0.0))),
        "--init-method-std", repr(config.initializer_range),
    ]  # fmt: skip
    if config.num_key_value_heads != config.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(config.num_key_value_heads)]
    if not config.tie_word_embeddings:
        flags.append("--untie-embeddings-and-output-weights")
    attention_bias = bool(getattr(config, "attention_bias", False))
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    if attention_bias != mlp_bias:
        raise ValueError(
            f"attention_bias={attention_bias}, mlp_bias={mlp_bias}: this project's linear "
            "biases are all on or all off (--disable-bias-linear)"
        )
    if not attention_bias:
        flags.append("--disable-bias-linear")
    if moe:
        if getattr(config, "sliding_window", None):
            raise ValueError(
                f"sliding_window={config.sliding_window}: this project's attention is global"
            )
        top_k = config.num_experts_per_tok
        flags += [
            "--moe-num-experts", str(config.num_local_experts), "--moe-top-k", str(top_k),
            "--moe-normalize-expert-weights", "1",
            "--moe-loss-weight", repr(config.router_aux_loss_coef * top_k),
        ]  # fmt: skip
    return flags


def from_hf(tensors: Dict[str, torch.Tensor], config, moe: bool) -> Dict[str, torch.Tensor]:
    """LlamaForCausalLM's or MixtralForCausalLM's tensors -> this project's state dict,
    vocabulary unpadded. Mixtral experts are read per expert (the Hub's layout) or fused
    (`mlp.experts.gate_up_proj` / `down_proj`, transformers 5's own)."""
    taken = set()

    def take(name: str) -> torch.Tensor:
        taken.add(name)
        return tensors[name]

    heads, groups = config.num_attention_heads, config.num_key_value_heads
    kinds = ("weight", "bias") if getattr(config, "attention_bias", False) else ("weight",)
    state = {"embedding.word_embeddings.weight": take("model.embed_tokens.weight")}
    for index in range(config.num_hidden_layers):
        ours, theirs = f"decoder.layers.{index}.", f"model.layers.{index}."
        state[ours + "input_layernorm.weight"] = take(theirs + "input_layernorm.weight")
        for kind in kinds:
            parts = [take(f"{theirs}self_attn.{name}.{kind}") for name in _ATTENTION]
            state[f"{ours}self_attention.linear_qkv.{kind}"] = _fuse_qkv(*parts, heads, groups)
            state[f"{ours}self_attention.linear_proj.{kind}"] = take(
                f"{theirs}self_attn.o_proj.{kind}"
            )
        state[ours + "pre_mlp_layernorm.weight"] = take(theirs + "post_attention_layernorm.weight")
        if not moe:
            for kind in kinds:
                gate, up = (take(f"{theirs}mlp.{name}.{kind}") for name in ("gate_proj", "up_proj"))
                state[f"{ours}mlp.linear_fc1.{kind}"] = torch.cat((gate, up), dim=0)
                state[f"{ours}mlp.linear_fc2.{kind}"] = take(f"{theirs}mlp.down_proj.{kind}")
            continue
        state.update(_experts_from_hf(take, tensors, ours, theirs, config))
    state["decoder.final_layernorm.weight"] = take("model.norm.weight")
    if not config.tie_word_embeddings:
        state["output_layer.weight"] = take("lm_head.weight")
    elif "lm_head.weight" in tensors:
        taken.add("lm_head.weight")
    leftover = sorted(set(tensors) - taken)
    if leftover:
        shown = ", ".join(leftover[:4]) + (" ..." if len(leftover) > 4 else "")
        raise ValueError(f"{len(leftover)} tensors have no place in the model: {shown}")
    return state


def _experts_from_hf(take, tensors, ours: str, theirs: str, config) -> Dict[str, torch.Tensor]:
    experts = config.num_local_experts
    legacy = f"{theirs}block_sparse_moe."
    if legacy + "gate.weight" in tensors:
        router = take(legacy + "gate.weight")
        w1 = torch.stack([take(f"{legacy}experts.{e}.w1.weight").t() for e in range(experts)])
        v1 = torch.stack([take(f"{legacy}experts.{e}.w3.weight").t() for e in range(experts)])
        w2 = torch.stack([take(f"{legacy}experts.{e}.w2.weight").t() for e in range(experts)])
    else:
        fused = f"{theirs}mlp."
        router = take(fused + "gate.weight")
        gate_up = take(fused + "experts.gate_up_proj")  # [E, 2f, h]
        gate, up = gate_up.chunk(2, dim=1)
        w1, v1 = gate.transpose(1, 2).contiguous(), up.transpose(1, 2).contiguous()
        down = take(fused + "experts.down_proj")  # [E, h, f]
        w2 = down.transpose(1, 2).contiguous()
    return {
        ours + "mlp.router.layer.weight": router,
        ours + "mlp.experts.w1": w1,
        ours + "mlp.experts.v1": v1,
        ours + "mlp.experts.w2": w2,
    }
