"""FLOPs and parameter counts of GPT-2 125M against hand computation."""

from __future__ import annotations

import torch

from megatron.config import ModelConfig
from megatron.model import GPTModel, count_parameters, num_floating_point_operations


def gpt2_125m(**overrides) -> ModelConfig:
    fields = dict(
        num_layers=12,
        hidden_size=768,
        num_attention_heads=12,
        ffn_hidden_size=3072,
        seq_length=1024,
        max_position_embeddings=1024,
        padded_vocab_size=50304,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def megatron_closed_form(config: ModelConfig, batch_size: int) -> float:
    """Megatron's training.num_floating_point_operations, transcribed (no MoE)."""
    groups = config.num_query_groups or config.num_attention_heads
    query_ratio = config.kv_channels * config.num_attention_heads / config.hidden_size
    gated = 3 / 2 if config.swiglu else 1
    h, s, L = config.hidden_size, config.seq_length, config.num_layers
    return (
        12 * batch_size * s * L * h * h
        * (
            (1 + groups / config.num_attention_heads + s / h) * query_ratio
            + config.ffn_hidden_size / h * gated
            + config.padded_vocab_size / (2 * L * h)
        )
    )  # fmt: skip


def test_gpt2_125m_flops():
    config = gpt2_125m()
    # Forward FLOPs per token, per layer: QKV 2*768*2304 = 3,538,944; proj 2*768*768 =
    # 1,179,648; scores and context 2 * 2*1024*768 = 3,145,728; fc1 + fc2 2 * 2*768*3072 =
    # 9,437,184; sum 17,301,504. x 12 layers = 207,618,048; logits 2*768*50304 = 77,266,944;
    # per token 284,884,992; x 3 (fwd + bwd) x 1024 tokens = 875,166,695,424 per sequence.
    flops = num_floating_point_operations(config, batch_size=1, seq_length=1024)
    print(f"GPT-2 125M model FLOPs per 1024-token sequence: {flops:,}")
    assert flops == 875_166_695_424
    assert num_floating_point_operations(config, batch_size=8, seq_length=1024) == 8 * flops
    assert flops == megatron_closed_form(config, 1)


def test_flops_match_megatron_with_gqa_and_swiglu():
    config = gpt2_125m(num_query_groups=4, swiglu=True, ffn_hidden_size=2048, seq_length=2048)
    flops = num_floating_point_operations(config, batch_size=2, seq_length=2048)
    assert abs(flops - megatron_closed_form(config, 2)) <= 1e-12 * flops


def test_gpt2_125m_parameter_count():
    # word embeddings 50304*768 = 38,633,472; positions 1024*768 = 786,432;
    # per layer: 2 LayerNorms 2*1,536 + QKV 768*2304+2304 = 1,771,776 + proj 768*768+768 =
    # 590,592 + fc1 768*3072+3072 = 2,362,368 + fc2 3072*768+768 = 2,360,064 -> 7,087,872;
    # x 12 = 85,054,464; final LayerNorm 1,536. Total (tied) 124,475,904.
    with torch.device("meta"):  # counting needs no memory or init time
        tied = GPTModel(gpt2_125m())
        untied = GPTModel(gpt2_125m(untie_embeddings_and_output_weights=True))
    assert count_parameters(tied) == 124_475_904
    # Untied adds the 50304 x 768 output layer.
    assert count_parameters(untied) == 124_475_904 + 38_633_472 == 163_109_376
