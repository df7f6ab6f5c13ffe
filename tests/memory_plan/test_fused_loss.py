"""The memory planner's logits row under --cross-entropy-fusion-impl linear."""

from __future__ import annotations

from gpt_pretraining import GPT_RUN
from megatron.kernels.linear_cross_entropy import CHUNK_LOGITS_BYTES
from megatron.memory_plan import estimate_memory
from megatron.memory_plan.command_line import build_config
from tests.memory_plan.test_memory_plan import DMOE_125M


def test_the_fused_linear_loss_keeps_one_chunk_of_logits():
    """--cross-entropy-fusion-impl linear: the logits row is one chunk's logits and their
    gradient, the fp32 output-weight gradient and the per-token losses and log-sum-exp, not the
    [tokens, vocabulary] logits (megatron.kernels.linear_cross_entropy)."""
    plain, _ = build_config(GPT_RUN, DMOE_125M, 1)
    fused, _ = build_config(GPT_RUN, [*DMOE_125M, "--cross-entropy-fusion-impl", "linear"], 1)
    plain_logits = estimate_memory(plain, GPT_RUN.mlp_spec(plain)).logits
    fused_estimate = estimate_memory(fused, GPT_RUN.mlp_spec(fused))
    vocab, hidden = fused.model.padded_vocab_size, fused.model.hidden_size
    tokens = 64 * 1024
    rows = CHUNK_LOGITS_BYTES // (vocab * 2)
    assert fused_estimate.logits == 2 * rows * vocab * 2 + 4 * vocab * hidden + 8 * tokens
    assert fused_estimate.logits < plain_logits / 10
    base = estimate_memory(plain, GPT_RUN.mlp_spec(plain))
    assert fused_estimate.activations == base.activations
