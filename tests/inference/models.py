"""The tiny random models the inference tests decode with: a GPT-2-style model, a
RoPE + RMSNorm + SwiGLU + GQA model with an untied output layer, and a dMoE GPT."""

from __future__ import annotations

from typing import Any, Dict

import torch

from megatron.model import DENSE_MLP, GPTModel
from moe.config import MoEConfig
from moe.mlp_spec import MoEMlpSpec
from tests.tiny_gpt import tiny_model_config

VOCAB = 64
# Weights large enough that the next token changes from step to step (at Megatron's 0.02 a tiny
# random model repeats one token, and every comparison would pass trivially).
INIT_STD = 0.3

MODELS: Dict[str, Dict[str, Any]] = {
    "gpt": {},
    "rope_rmsnorm_swiglu_gqa": dict(
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        num_query_groups=2,
        untie_embeddings_and_output_weights=True,
        add_bias_linear=False,
    ),
    "dmoe": {},
}


def tiny_model(name: str, seed: int = 0) -> GPTModel:
    """The model `name` of MODELS in fp32 eval mode, weights drawn with `seed`."""
    config = tiny_model_config(
        padded_vocab_size=VOCAB,
        max_position_embeddings=48,
        seq_length=48,
        init_method_std=INIT_STD,
        **MODELS[name],
    )
    spec = MoEMlpSpec(MoEConfig(num_experts=4, top_k=2)) if name == "dmoe" else DENSE_MLP
    torch.manual_seed(seed)
    return GPTModel(config, spec).eval()
