"""Text in, text out: prompts tokenized, generated in batches by a GenerationEngine, detokenized.

What tools/generate.py and tools/run_text_generation_server.py share. An empty prompt starts
from the end-of-document token, the boundary every training document follows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Protocol, Sequence

import torch

from megatron.inference.engine import GenerationEngine
from megatron.inference.sampling import GREEDY, SamplingOptions, make_generator


class Tokenizer(Protocol):
    """What generation needs of a megatron.tokenizer tokenizer."""

    eod: int
    vocab_size: int

    def tokenize(self, text: str) -> List[int]: ...

    def detokenize(self, token_ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class Completion:
    """One prompt's result: its tokens, the generated tokens and the generated text."""

    prompt: str
    prompt_tokens: List[int]
    tokens: List[int]
    text: str

    @property
    def full_text(self) -> str:
        """The prompt followed by its completion (what Megatron's server returns)."""
        return self.prompt + self.text


class TextGenerator:
    """Completes prompts with `engine`, at most `max_batch_size` prompts per batch."""

    def __init__(self, engine: GenerationEngine, tokenizer: Tokenizer, max_batch_size: int = 32):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size {max_batch_size} must be >= 1")
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size

    def tokenize(self, prompt: str) -> List[int]:
        """The prompt's token ids; [eod] for an empty prompt."""
        return self.tokenizer.tokenize(prompt) or [self.tokenizer.eod]

    def complete(
        self,
        prompts: Sequence[str],
        tokens_to_generate: int,
        sampling: SamplingOptions = GREEDY,
        stop_at_eod: bool = True,
    ) -> List[Completion]:
        """The completion of each prompt, in order. Sampling draws from one generator seeded
        with `sampling.seed` across the batches, so a seed reproduces the whole call."""
        generator: Optional[torch.Generator] = None
        if not sampling.greedy:
            generator = make_generator(sampling.seed, self.engine.device)
        completions: List[Completion] = []
        for start in range(0, len(prompts), self.max_batch_size):
            batch = list(prompts[start : start + self.max_batch_size])
            prompt_tokens = [self.tokenize(prompt) for prompt in batch]
            new_tokens = self.engine.generate(
                prompt_tokens, tokens_to_generate, sampling, stop_at_eod, generator
            )
            for prompt, tokens, generated in zip(batch, prompt_tokens, new_tokens):
                text = self.tokenizer.detokenize(generated) if generated else ""
                completions.append(Completion(prompt, tokens, generated, text))
        return completions
