"""Token-level generation with a GPTModel: left-padded batched prompts, prefill, then one token
per step from the KV cache, greedy or sampled, until N tokens or every row's end-of-document.

    engine = GenerationEngine(model, eod=tokenizer.eod, vocab_size=tokenizer.vocab_size)
    new_tokens = engine.generate([[464, 3290], [15496]], max_new_tokens=32,
                                 sampling=SamplingOptions(greedy=True))

The model runs in its own dtype (cast it before: bf16 on GPUs, fp32 on the CPU); no autocast.
The cache and the captured decode step are kept for the next call with the same batch size that
fits them. A padded row gives the tokens its prompt gives alone (each row attends only its own
real tokens, at positions counted from its first real token) as long as the model treats
tokens independently: dense and dropless-MoE layers do; an MoE with expert capacity does not
(which tokens it drops depends on the whole batch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Sequence

import torch

from megatron.inference.cuda_graph import DecodeStepRunner
from megatron.inference.decode import prefill
from megatron.inference.kv_cache import KVCache, round_capacity
from megatron.inference.sampling import GREEDY, SamplingOptions, make_generator, sample_tokens

if TYPE_CHECKING:
    from megatron.model import GPTModel


class GenerationEngine:
    """Generates with `model` (a whole single-process GPTModel, put in eval mode here).

    `eod` ends a row's generation (and pads prompts); `vocab_size` is the tokenizer's
    vocabulary, below the padded one of the model: tokens above it are never chosen.
    `cuda_graphs` captures the decode step on CUDA devices (megatron.inference.cuda_graph).
    """

    def __init__(
        self,
        model: GPTModel,
        eod: int,
        vocab_size: Optional[int] = None,
        cuda_graphs: bool = True,
    ) -> None:
        sharded = any(getattr(p, "tensor_model_parallel", False) for p in model.parameters())
        if not (model.pre_process and model.post_process) or sharded:
            raise ValueError(
                "generation needs the whole model of one process (a pipeline stage or a "
                "tensor-parallel shard was given); build it from the checkpoint with "
                "gpt_pretraining.checkpoint_model"
            )
        self.model = model.eval()
        self.config = model.config
        self.eod = eod
        self.vocab_size = vocab_size or model.config.padded_vocab_size
        self.cuda_graphs = cuda_graphs
        weight = model.output_weight()
        self.device, self.dtype = weight.device, weight.dtype
        self._cache: Optional[KVCache] = None
        self._runner: Optional[DecodeStepRunner] = None

    @property
    def decode_mode(self) -> str:
        """How the last generation ran its decode steps ("CUDA graph", "eager", or why not)."""
        return self._runner.mode if self._runner is not None else "not run yet"

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        sampling: SamplingOptions = GREEDY,
        stop_at_eod: bool = True,
        generator: Optional[torch.Generator] = None,
    ) -> List[List[int]]:
        """The new token ids of each prompt in one batch: `max_new_tokens` of them, or fewer
        where the row chose `eod` first (`stop_at_eod`; eod itself is not returned). Sampling
        draws from `generator` (on the model's device) when given, else from one seeded with
        `sampling.seed`."""
        lengths = [len(prompt) for prompt in prompts]
        if not prompts or min(lengths) == 0:
            raise ValueError("every prompt needs at least one token (got an empty one or none)")
        if max_new_tokens < 0:
            raise ValueError(f"tokens to generate {max_new_tokens} must be >= 0")
        if max_new_tokens == 0:
            return [[] for _ in prompts]
        self._check_positions(max(lengths), max_new_tokens)
        batch_size, padded_length = len(prompts), max(lengths)
        runner = self._prepare(batch_size, padded_length + max_new_tokens - 1)
        tokens = torch.full((batch_size, padded_length), self.eod, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            tokens[row, padded_length - len(prompt) :] = torch.as_tensor(prompt, dtype=torch.long)
        tokens = tokens.to(self.device)
        prompt_lengths = torch.as_tensor(lengths, dtype=torch.long).to(self.device)

        if generator is None and not sampling.greedy:
            generator = make_generator(sampling.seed, self.device)
        new_tokens = torch.full(
            (batch_size, max_new_tokens), self.eod, dtype=torch.long, device=self.device
        )
        finished = torch.zeros(batch_size, dtype=torch.bool, device=self.device)
        poll = _FinishedPoll(self.device)
        logits = prefill(self.model, self._cache, tokens, prompt_lengths)
        for step in range(max_new_tokens):
            token = sample_tokens(logits[:, : self.vocab_size], sampling, generator)
            if stop_at_eod:
                token = token.masked_fill(finished, self.eod)
                finished |= token == self.eod
            new_tokens[:, step] = token
            if step == max_new_tokens - 1 or (stop_at_eod and poll.all_finished(finished)):
                break
            logits = runner(token)
        return [_until_eod(row, self.eod if stop_at_eod else None) for row in new_tokens.tolist()]

    def _check_positions(self, longest_prompt: int, max_new_tokens: int) -> None:
        # The last new token is never fed back, so the highest position used is this one.
        highest = longest_prompt + max_new_tokens - 2
        limit = self.config.max_position_embeddings
        if self.config.position_embedding_type == "learned_absolute" and highest >= limit:
            raise ValueError(
                f"a prompt of {longest_prompt} tokens plus {max_new_tokens} tokens to generate "
                f"needs {highest + 1} positions, but the model has max_position_embeddings="
                f"{limit}; generate at most {limit - longest_prompt + 1} tokens or shorten "
                "the prompt"
            )

    def _prepare(self, batch_size: int, slots: int) -> DecodeStepRunner:
        """The cache and decode runner for `batch_size` rows of `slots` slots: the last ones
        when they fit, else new ones (captured again)."""
        if self._cache is None or not self._cache.fits(batch_size, slots, self.dtype):
            self._cache = self._runner = None  # free the old buffers and graph first
            attention = self.model.decoder.layers[0].self_attention
            self._cache = KVCache.allocate(
                len(self.model.decoder.layers),
                batch_size,
                attention.num_query_groups,
                round_capacity(slots),
                attention.head_dim,
                self.dtype,
                self.device,
            )
            self._runner = DecodeStepRunner(self.model, self._cache, self.cuda_graphs)
        return self._runner


class _FinishedPoll:
    """Whether every row has finished, without stalling the GPU: on CUDA the flag is copied to
    pinned host memory behind the queued steps and read once that copy has landed, so the loop
    stops a few steps late instead of waiting for each step."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host_flag = torch.zeros((), dtype=torch.bool, pin_memory=self.cuda)
        self.event: Optional[torch.cuda.Event] = None

    def all_finished(self, finished: torch.Tensor) -> bool:
        """True once the copy of `finished.all()` from an earlier step says so."""
        if not self.cuda:
            return bool(finished.all())
        if self.event is not None:
            if not self.event.query():
                return False
            self.event = None
            if bool(self.host_flag):
                return True
        self.host_flag.copy_(finished.all(), non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()
        return False


def _until_eod(tokens: List[int], eod: Optional[int]) -> List[int]:
    if eod is not None and eod in tokens:
        return tokens[: tokens.index(eod)]
    return tokens
