"""GPT-2 (learned positions, LayerNorm, GELU, biases, tied embeddings) <-> `GPT2LMHeadModel`.

Hugging Face's GPT-2 stores its linear layers as `Conv1D`, weights [in, out], the transpose of
ours; its fused attention projection holds all query heads, then all key heads, then all value
heads, where ours holds [q | k | v] per head (megatron.model.attention). The mapping is a pure
permutation of every tensor, so a round trip reproduces each bit.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from megatron.config import ModelConfig

ARCHITECTURE = "GPT2LMHeadModel"
# Hugging Face activations computing GELU's tanh approximation, as this project's MLP does.
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
# Causal-mask buffers older GPT-2 files carry; not weights.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def refusals(model: ModelConfig, moe: Optional[object]) -> List[str]:
    """What of this model GPT2LMHeadModel cannot express (empty when it maps exactly)."""
    problems = []
    if moe is not None:
        problems.append("MoE layers (--moe-num-experts)")
    if model.position_embedding_type != "learned_absolute":
        problems.append(f"--position-embedding-type {model.position_embedding_type}")
    if model.normalization != "LayerNorm":
        problems.append(f"--normalization {model.normalization}")
    if model.swiglu:
        problems.append("--swiglu")
    if not model.add_bias_linear:
        problems.append("--disable-bias-linear")
    if model.untie_embeddings_and_output_weights:
        problems.append("--untie-embeddings-and-output-weights")
    if model.num_query_groups not in (0, model.num_attention_heads):
        problems.append(f"--num-query-groups {model.num_query_groups}")
    return problems


def hf_config(model: ModelConfig, vocab_size: int, eod: int):
    """The GPT2Config of `model` with `vocab_size` tokens."""
    from transformers import GPT2Config

    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=model.max_position_embeddings,
        n_embd=model.hidden_size,
        n_layer=model.num_layers,
        n_head=model.num_attention_heads,
        n_inner=model.ffn_hidden_size,
        activation_function="gelu_pytorch_tanh",
        resid_pdrop=model.hidden_dropout,
        embd_pdrop=model.hidden_dropout,
        attn_pdrop=model.attention_dropout,
        layer_norm_epsilon=model.layernorm_epsilon,
        initializer_range=model.init_method_std,
        bos_token_id=eod,
        eos_token_id=eod,
        tie_word_embeddings=True,
    )
    config.architectures = [ARCHITECTURE]
    return config


def _heads_to_hf(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """[heads x (q, k, v) x d, ...] -> [(q, k, v) x heads x d, ...]."""
    rest = tensor.shape[1:]
    return tensor.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(-1, *rest)


def _heads_from_hf(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    rest = tensor.shape[1:]
    return tensor.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(-1, *rest)


def to_hf(state: Dict[str, torch.Tensor], model: ModelConfig, vocab_size: int) -> Dict:
    """This project's single-process state dict -> GPT2LMHeadModel's tensors (vocabulary rows
    beyond `vocab_size`, the padding, dropped; the output layer tied, so not stored)."""
    heads = model.num_attention_heads
    out = {
        "transformer.wte.weight": state["embedding.word_embeddings.weight"][:vocab_size],
        "transformer.wpe.weight": state["embedding.position_embeddings.weight"],
        "transformer.ln_f.weight": state["decoder.final_layernorm.weight"],
        "transformer.ln_f.bias": state["decoder.final_layernorm.bias"],
    }
    for index in range(model.num_layers):
        ours, theirs = f"decoder.layers.{index}.", f"transformer.h.{index}."
        out[theirs + "ln_1.weight"] = state[ours + "input_layernorm.weight"]
        out[theirs + "ln_1.bias"] = state[ours + "input_layernorm.bias"]
        qkv = ours + "self_attention.linear_qkv."
        out[theirs + "attn.c_attn.weight"] = _heads_to_hf(state[qkv + "weight"], heads).t()
        out[theirs + "attn.c_attn.bias"] = _heads_to_hf(state[qkv + "bias"], heads)
        out[theirs + "attn.c_proj.weight"] = state[ours + "self_attention.linear_proj.weight"].t()
        out[theirs + "attn.c_proj.bias"] = state[ours + "self_attention.linear_proj.bias"]
        out[theirs + "ln_2.weight"] = state[ours + "pre_mlp_layernorm.weight"]
        out[theirs + "ln_2.bias"] = state[ours + "pre_mlp_layernorm.bias"]
        out[theirs + "mlp.c_fc.weight"] = state[ours + "mlp.linear_fc1.weight"].t()
        out[theirs + "mlp.c_fc.bias"] = state[ours + "mlp.linear_fc1.bias"]
        out[theirs + "mlp.c_proj.weight"] = state[ours + "mlp.linear_fc2.weight"].t()
        out[theirs + "mlp.c_proj.bias"] = state[ours + "mlp.linear_fc2.bias"]
    return out


def model_flags(config) -> List[str]:
    """pretrain_gpt.py's model flags for a GPT2Config; ValueError for what does not map."""
    activation = config.activation_function
    if activation not in TANH_GELUS:
        raise ValueError(
            f"activation_function={activation!r}: this project's GPT-2 MLP computes GELU's tanh "
            f"approximation ({', '.join(TANH_GELUS)}); the model cannot be imported exactly"
        )
    if getattr(config, "scale_attn_by_inverse_layer_idx", False) or getattr(
        config, "reorder_and_upcast_attn", False
    ):
        raise ValueError(
            "scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn change GPT-2's attention; "
            "this project's attention is the plain one"
        )
    ffn = config.n_inner or 4 * config.n_embd
    return [
        "--num-layers", str(config.n_layer), "--hidden-size", str(config.n_embd),
        "--num-attention-heads", str(config.n_head), "--ffn-hidden-size", str(ffn),
        "--max-position-embeddings", str(config.n_positions),
        "--seq-length", str(config.n_positions),
        "--layernorm-epsilon", repr(config.layer_norm_epsilon),
        "--hidden-dropout", repr(config.resid_pdrop),
        "--attention-dropout", repr(config.attn_pdrop),
        "--init-method-std", repr(config.initializer_range),
    ]  # fmt: skip


def from_hf(tensors: Dict[str, torch.Tensor], config) -> Dict[str, torch.Tensor]:
    """GPT2LMHeadModel's tensors (with or without the `transformer.` prefix of GPT2Model
    files) -> this project's state dict, vocabulary unpadded."""
    tensors = {
        (name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name): value
        for name, value in tensors.items()
        if not name.endswith(IGNORED_SUFFIXES)
    }
    heads = config.n_head
    taken = set()

    def take(name: str) -> torch.Tensor:
        taken.add(name)
        return tensors[name]

    state = {
        "embedding.word_embeddings.weight": take("transformer.wte.weight"),
        "embedding.position_embeddings.weight": take("transformer.wpe.weight"),
    }
    for index in range(config.n_layer):
        ours, theirs = f"decoder.layers.{index}.", f"transformer.h.{index}."
        state[ours + "input_layernorm.weight"] = take(theirs + "ln_1.weight")
        state[ours + "input_layernorm.bias"] = take(theirs + "ln_1.bias")
        qkv = ours + "self_attention.linear_qkv."
        state[qkv + "weight"] = _heads_from_hf(take(theirs + "attn.c_attn.weight").t(), heads)
        state[qkv + "bias"] = _heads_from_hf(take(theirs + "attn.c_attn.bias"), heads)
        proj = ours + "self_attention.linear_proj."
        state[proj + "weight"] = take(theirs + "attn.c_proj.weight").t()
        state[proj + "bias"] = take(theirs + "attn.c_proj.bias")
        state[ours + "pre_mlp_layernorm.weight"] = take(theirs + "ln_2.weight")
        state[ours + "pre_mlp_layernorm.bias"] = take(theirs + "ln_2.bias")
        state[ours + "mlp.linear_fc1.weight"] = take(theirs + "mlp.c_fc.weight").t()
        state[ours + "mlp.linear_fc1.bias"] = take(theirs + "mlp.c_fc.bias")
        state[ours + "mlp.linear_fc2.weight"] = take(theirs + "mlp.c_proj.weight").t()
        state[ours + "mlp.linear_fc2.bias"] = take(theirs + "mlp.c_proj.bias")
    state["decoder.final_layernorm.weight"] = take("transformer.ln_f.weight")
    state["decoder.final_layernorm.bias"] = take("transformer.ln_f.bias")
    lm_head = tensors.get("lm_head.weight")
    if lm_head is not None:
        taken.add("lm_head.weight")
        if not torch.equal(lm_head, state["embedding.word_embeddings.weight"]):
            raise ValueError(
                "lm_head.weight differs from transformer.wte.weight: GPT-2's output layer is "
                "tied to its embeddings here"
            )
    _refuse_leftovers(tensors, taken)
    return state


def _refuse_leftovers(tensors: Dict[str, torch.Tensor], taken: set) -> None:
    leftover = sorted(set(tensors) - taken)
    if leftover:
        shown = ", ".join(leftover[:4]) + (" ..." if len(leftover) > 4 else "")
        raise ValueError(f"{len(leftover)} tensors have no place in the model: {shown}")
