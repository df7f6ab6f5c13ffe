"""Parallel forms of the plain model's parameterless parts.

The plain model (megatron.model) calls small parts where tensor parallelism changes what happens
between its layers: the output head that turns hidden states into logits or losses, its dropout
modules, its core attention. The tensor-parallel step (megatron.parallelize.tensor_parallelism)
swaps those parts for the forms here, as it swaps a torch linear layer for its column- or
row-parallel form; the plain model's code never asks which form it holds. None of them holds a
parameter, so a swap changes no checkpoint key.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.tensor_parallel.random import sharded_dropout_rng


class PerRankRandom(nn.Module):
    """`module` drawing its random numbers (dropout masks, noise) from this tensor-parallel
    rank's stream while training: for a module whose input differs across tensor-parallel ranks
    (a share of the heads, a sequence shard), where one mask repeated on every shard would
    correlate them (megatron.tensor_parallel.random)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        with sharded_dropout_rng(self.training):
            return self.module(*args, **kwargs)


class PerRankRandomScope(nn.Module):
    """The parallel form of a block's random source (megatron.model.transformer.DefaultRandom):
    while training, everything the block's layers draw comes from this tensor-parallel rank's
    stream. For a block whose residual stream is a sequence shard: one scope around all its
    layers rather than one per dropout, so a compiled model breaks its graph once."""

    def scope(self) -> contextlib.AbstractContextManager:
        return sharded_dropout_rng(self.training)


class SequenceShard(nn.Module):
    """[b, s, h] replicated on every tensor-parallel rank -> this rank's sequence shard
    [b, s / tp, h] (backward all-gathers): where sequence parallelism's region begins."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return scatter_to_sequence_parallel_region(hidden_states)


class VocabParallelOutputHead(nn.Module):
    """The output head (megatron.model.gpt_model.OutputHead) over this rank's vocabulary rows of
    the output weight: logits [b, s, vocab / tp], or with labels the per-token losses of the
    vocabulary-parallel cross-entropy, identical on every rank. The full [b, s, vocab] logits
    never exist on one rank. With `sequence_parallel` the hidden states arrive as sequence
    shards and are all-gathered (backward reduce-scatters: each rank's vocabulary share gives a
    partial input gradient); otherwise they are replicated and their gradient is all-reduced."""

    def __init__(self, sequence_parallel: bool) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def forward(
        self,
        hidden_states: torch.Tensor,
        weight: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if self.sequence_parallel:
            hidden_states = gather_from_sequence_parallel_region(hidden_states)
        else:
            hidden_states = copy_to_tensor_model_parallel_region(hidden_states)
        logits = F.linear(hidden_states, weight)
        if labels is None:
            return logits
        return vocab_parallel_cross_entropy(logits, labels)
