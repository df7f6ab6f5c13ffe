"""Choosing the next token from logits: greedy, or sampling with temperature, top-k and top-p.

Everything runs on the logits' device without a host sync: the draw is the exponential race
(argmax of p / E with E ~ Exp(1) drawn from the caller's generator, which picks token i with
probability p_i), not torch.multinomial, whose checks read the probabilities on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class SamplingOptions:
    """How a token is chosen: `greedy` takes the most likely one; otherwise the logits are
    divided by `temperature`, cut to the `top_k` most likely tokens (0: no cut) and to the
    nucleus of probability `top_p` (0 or 1: no cut), then sampled with `seed`."""

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        if not self.temperature > 0.0:
            raise ValueError(
                f"temperature {self.temperature} must be > 0 (use greedy decoding instead of 0)"
            )
        if self.top_k < 0:
            raise ValueError(f"top_k {self.top_k} must be >= 0 (0 keeps every token)")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p {self.top_p} must lie in [0, 1] (0 or 1 keeps every token)")


GREEDY = SamplingOptions(greedy=True)


def filter_logits(logits: torch.Tensor, options: SamplingOptions) -> torch.Tensor:
    """fp32 logits [b, vocab] divided by the temperature, with every token outside the top-k
    and outside the top-p nucleus set to -inf.

    The nucleus is the smallest set of most likely tokens whose probability reaches top_p: a
    token stays when the tokens more likely than it hold less than top_p (so the most likely
    token always stays).
    """
    logits = logits.float() / options.temperature
    if options.top_k > 0 and options.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, options.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if 0.0 < options.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        outside_sorted = mass_before >= options.top_p
        outside = torch.empty_like(outside_sorted).scatter_(-1, order, outside_sorted)
        logits = logits.masked_fill(outside, float("-inf"))
    return logits


def sample_tokens(
    logits: torch.Tensor, options: SamplingOptions, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """The next token of each row of logits [b, vocab]: int64 [b]."""
    if options.greedy:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, options).softmax(dim=-1)
    race = torch.empty_like(probs).exponential_(generator=generator)
    # A draw of exactly 0 would turn a masked token's 0 / 0 into NaN, which argmax picks.
    race.clamp_(min=torch.finfo(race.dtype).tiny)
    return (probs / race).argmax(dim=-1)


def make_generator(seed: Optional[int], device: torch.device) -> torch.Generator:
    """A generator on `device` seeded with `seed`, or from fresh entropy when `seed` is None."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
