"""What an exported Hugging Face directory of a GPT-2 dMoE needs beyond its weights: the two
remote-code files and a config.json whose `auto_map` points at them.

    fields = megatron_dmoe_config_from(model_config, moe_config, vocab_size, eos_token_id)
    remote_code_config(**fields).save_pretrained(save_dir)   # config.json with auto_map
    write_remote_code(save_dir)                              # the configuration and modeling files

The weights go beside them under this project's own checkpoint keys (the modeling file's
parameter names), the padded vocabulary rows dropped, a tied output layer stored once.
`megatron_dmoe_config_from` refuses, with one line naming the flag, a model the modeling file
would compute differently.
"""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING, Any, Dict, List, Optional

if TYPE_CHECKING:
    from gpt_pretraining.huggingface.remote_code.configuration_megatron_dmoe import (
        MegatronDMoEConfig,
    )
    from megatron.config import ModelConfig
    from moe.config import MoEConfig

REMOTE_CODE_DIR = os.path.dirname(os.path.abspath(__file__))
REMOTE_CODE_FILES = (
    "configuration_megatron_dmoe.py",
    "modeling_megatron_dmoe.py",
    "routing_megatron_dmoe.py",
)
MODEL_TYPE = "megatron_dmoe"
ARCHITECTURES = ["MegatronDMoEForCausalLM"]
AUTO_MAP = {
    "AutoConfig": "configuration_megatron_dmoe.MegatronDMoEConfig",
    "AutoModelForCausalLM": "modeling_megatron_dmoe.MegatronDMoEForCausalLM",
}


def write_remote_code(save_dir: str) -> List[str]:
    """Copy the configuration and modeling files into `save_dir` (created if missing); returns
    the paths written."""
    os.makedirs(save_dir, exist_ok=True)
    written = []
    for name in REMOTE_CODE_FILES:
        target = os.path.join(save_dir, name)
        shutil.copyfile(os.path.join(REMOTE_CODE_DIR, name), target)
        written.append(target)
    return written


def remote_code_config(**fields: Any) -> MegatronDMoEConfig:
    """MegatronDMoEConfig(**fields) with `auto_map` and `architectures` set, so that its
    `save_pretrained` writes a config.json that `AutoConfig` and `AutoModelForCausalLM` resolve
    to the files `write_remote_code` copies."""
    # Imported here: the config mapping below needs no transformers.
    from gpt_pretraining.huggingface.remote_code.configuration_megatron_dmoe import (
        MegatronDMoEConfig,
    )

    config = MegatronDMoEConfig(**fields)
    config.auto_map = dict(AUTO_MAP)
    config.architectures = list(ARCHITECTURES)
    return config


def megatron_dmoe_config_from(
    model_config: ModelConfig,
    moe_config: Optional[MoEConfig],
    vocab_size: int,
    eos_token_id: Optional[int],
    bos_token_id: Optional[int] = None,
) -> Dict[str, Any]:
    """MegatronDMoEConfig's fields for a model of this project: `vocab_size` is the tokenizer's
    (the padded rows are not exported); `bos_token_id` defaults to `eos_token_id` (GPT-2's
    <|endoftext|> is both).

    Raises ValueError, one line naming the flag, for what the modeling file does not compute:
    a dense model, RoPE, RMSNorm, the capacity-limited MoE, a shared expert. Every routing the
    project trains exports (the --moe-router-* fields; the expert bias goes with the weights).
    """
    _check_supported(model_config, moe_config, vocab_size)
    return {
        "vocab_size": vocab_size,
        "hidden_size": model_config.hidden_size,
        "num_layers": model_config.num_layers,
        "num_attention_heads": model_config.num_attention_heads,
        "num_query_groups": model_config.num_query_groups or model_config.num_attention_heads,
        "ffn_hidden_size": model_config.ffn_hidden_size,
        "max_position_embeddings": model_config.max_position_embeddings,
        "layernorm_epsilon": model_config.layernorm_epsilon,
        "add_bias_linear": model_config.add_bias_linear,
        "tie_word_embeddings": not model_config.untie_embeddings_and_output_weights,
        "num_experts": moe_config.num_experts,
        "moe_top_k": moe_config.top_k,
        # An integer, or the pattern's marks as 0s and 1s (JSON has no tuples of bools).
        "moe_layer_freq": (
            moe_config.layer_freq
            if isinstance(moe_config.layer_freq, int)
            else [int(mark) for mark in moe_config.layer_freq]
        ),
        # None: the experts take ffn_hidden_size, as the flag's absence means.
        "moe_ffn_hidden_size": moe_config.ffn_hidden_size,
        "mlp_type": moe_config.mlp_type,
        # The project picks every MLP's activation by --swiglu (moe.layers, megatron.model.mlp).
        "activation": "silu" if model_config.swiglu else "gelu",
        "normalize_expert_weights": moe_config.normalize_expert_weights,
        "moe_router_score": moe_config.router_score,
        "moe_router_pre_softmax": moe_config.router_pre_softmax,
        "moe_router_topk_scaling_factor": moe_config.router_topk_scaling_factor,
        # > 0: the routers hold the expert bias, which the weights carry.
        "moe_router_bias_update_rate": moe_config.router_bias_update_rate,
        "moe_router_dtype": moe_config.router_dtype,
        "initializer_range": model_config.init_method_std,
        "bos_token_id": eos_token_id if bos_token_id is None else bos_token_id,
        "eos_token_id": eos_token_id,
    }


def _check_supported(
    model_config: ModelConfig, moe_config: Optional[MoEConfig], vocab_size: int
) -> None:
    """Raise ValueError for a model MegatronDMoEForCausalLM would not reproduce."""
    unsupported = (
        "is not supported by the Hugging Face dMoE export (gpt_pretraining/huggingface/remote_code)"
    )
    if moe_config is None:
        raise ValueError(
            f"a dense model (no --moe-num-experts) {unsupported}: it exports the dMoE only"
        )
    if model_config.position_embedding_type != "learned_absolute":
        raise ValueError(
            f"--position-embedding-type {model_config.position_embedding_type} {unsupported}: "
            "it has learned absolute positions only"
        )
    if model_config.normalization != "LayerNorm":
        raise ValueError(
            f"--normalization {model_config.normalization} {unsupported}: it has LayerNorm only"
        )
    if not moe_config.dropless:
        raise ValueError(
            f"--no-moe-dropless (MoE with capacity, which drops tokens) {unsupported}: "
            "it computes the dropless dMoE"
        )
    if moe_config.shared_expert:
        raise ValueError(f"--moe-shared-expert {unsupported}")
    padded = model_config.padded_vocab_size
    if not 0 < vocab_size <= padded:
        raise ValueError(
            f"vocab_size {vocab_size} must be between 1 and the model's padded vocabulary "
            f"{padded} (--make-vocab-size-divisible-by pads the tokenizer's size up to it)"
        )
