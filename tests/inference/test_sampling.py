"""Sampling (megatron.inference.sampling): top-k 1 is greedy, a seed reproduces a generation,
top-p keeps exactly the nucleus, top-k exactly the k likeliest, and bad options are refused."""

from __future__ import annotations

import pytest
import torch

from megatron.inference import GenerationEngine, SamplingOptions, filter_logits, sample_tokens
from tests.inference.models import VOCAB, tiny_model

PROMPTS = [[3, 17, 42, 8, 25], [9, 1]]


def test_top_k_1_is_greedy():
    engine = GenerationEngine(tiny_model("rope_rmsnorm_swiglu_gqa"), eod=VOCAB - 1)
    greedy = engine.generate(PROMPTS, 10, SamplingOptions(greedy=True), stop_at_eod=False)
    top_1 = SamplingOptions(top_k=1, temperature=0.7, seed=3)
    assert engine.generate(PROMPTS, 10, top_1, stop_at_eod=False) == greedy


def test_a_seed_reproduces_a_sampled_generation():
    engine = GenerationEngine(tiny_model("gpt"), eod=VOCAB - 1)

    def sampled(seed):
        options = SamplingOptions(temperature=1.5, top_k=20, top_p=0.95, seed=seed)
        return engine.generate(PROMPTS, 16, options, stop_at_eod=False)

    first = sampled(7)
    assert sampled(7) == first
    assert sampled(8) != first
    greedy = engine.generate(PROMPTS, 16, SamplingOptions(greedy=True), stop_at_eod=False)
    assert first != greedy  # really sampled


def test_top_p_keeps_the_nucleus():
    probabilities = torch.tensor([[0.05, 0.5, 0.15, 0.3], [0.25, 0.25, 0.25, 0.25]])
    logits = probabilities.log()
    kept = filter_logits(logits, SamplingOptions(top_p=0.7)).isfinite()
    # 0.5 alone is short of 0.7, 0.5 + 0.3 reaches it; a uniform row keeps 3 of 4.
    assert kept.tolist() == [[False, True, False, True], [True, True, True, False]]
    generator = torch.Generator().manual_seed(0)
    draws = sample_tokens(logits[:1].expand(2000, -1), SamplingOptions(top_p=0.7), generator)
    assert set(draws.tolist()) == {1, 3}
    share_of_1 = (draws == 1).float().mean().item()
    assert abs(share_of_1 - 0.5 / 0.8) < 0.04  # renormalized within the nucleus


def test_top_k_keeps_the_k_likeliest_and_temperature_scales():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]])
    filtered = filter_logits(logits, SamplingOptions(top_k=2, temperature=2.0))
    assert filtered.isfinite().tolist() == [[False, True, True, False, False]]
    assert filtered[0, 1].item() == 2.0


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(temperature=0.0), "temperature 0.0 must be > 0"),
        (dict(top_k=-1), "top_k -1 must be >= 0"),
        (dict(top_p=1.5), r"top_p 1.5 must lie in \[0, 1\]"),
    ],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingOptions(**options)
