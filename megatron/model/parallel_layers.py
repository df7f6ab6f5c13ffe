"""Where the GPT model becomes tensor-parallel: the layer builders the model modules call.

Each builder returns the plain torch layer when `config.tensor_model_parallel_size` is 1, so a
single GPU runs exactly the nanoGPT-like model with its checkpoint keys, and Megatron's parallel
layer (`megatron.tensor_parallel`) above it:

- `column_parallel_linear`: output features split over TP ranks, output left split
  (``gather_output=False``): attention's fused QKV and the MLP's fc1;
- `row_parallel_linear`: input features split, partial results summed (or reduce-scattered
  along the sequence with sequence parallelism): attention's output projection and fc2;
- `word_embedding`: vocabulary rows split; the tied output layer reuses this rank's rows.

Initialization. `GPTModel.init_weights` redraws every weight from the default generator in
module order, drawing the *full* weight of a parallel layer and keeping this rank's shard, so its
numbers match the TP=1 model only if the generator is in the same state when it starts. Building
a plain layer draws too (torch's default init), and a parallel layer draws differently; so the
builders first build (and drop) the plain layer, then the parallel one without touching the
generator. The TP=1 model, and the draws it makes, stay exactly as they were.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, ContextManager

import torch
from torch import nn

from megatron import parallel_state
from megatron.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    model_parallel_rng_tracker,
)

if TYPE_CHECKING:
    from megatron.config import ModelConfig


def is_tensor_parallel(config: ModelConfig) -> bool:
    """Whether `config` splits layers over more than one rank."""
    return config.tensor_model_parallel_size > 1


def check_tensor_parallel_state(config: ModelConfig) -> None:
    """The process groups must exist for the TP size the config asks for (the layers read them)."""
    groups_size = parallel_state.get_tensor_model_parallel_world_size()
    if groups_size != config.tensor_model_parallel_size:
        raise ValueError(
            f"the model config asks for tensor_model_parallel_size="
            f"{config.tensor_model_parallel_size} but the tensor-parallel group has {groups_size} "
            "rank(s); call megatron.parallel_state.initialize_model_parallel("
            "tensor_model_parallel_size=...) with the same size before building the model"
        )


def _built_after_plain_layer_draws(
    plain: Callable[[], nn.Module], parallel: Callable[[], nn.Module]
) -> nn.Module:
    # See the module docstring: advance the generator as the TP=1 build would, then build the
    # parallel layer (whose own full-size draw init_weights replaces) on a forked generator.
    plain()
    with torch.random.fork_rng(devices=[]):
        return parallel()


def column_parallel_linear(
    config: ModelConfig, input_size: int, output_size: int, bias: bool, stride: int = 1
) -> nn.Module:
    """nn.Linear, or a ColumnParallelLinear whose output stays split over TP ranks.

    ``stride`` 2 splits a fused ``[gate; up]`` weight so each rank holds its gate and its up rows.
    """
    if not is_tensor_parallel(config):
        return nn.Linear(input_size, output_size, bias=bias)
    return _built_after_plain_layer_draws(
        lambda: nn.Linear(input_size, output_size, bias=bias),
        lambda: ColumnParallelLinear(
            input_size,
            output_size,
            bias=bias,
            gather_output=False,
            sequence_parallel=config.sequence_parallel,
            stride=stride,
        ),
    )


def row_parallel_linear(
    config: ModelConfig, input_size: int, output_size: int, bias: bool
) -> nn.Module:
    """nn.Linear, or a RowParallelLinear taking a column-parallel layer's split output."""
    if not is_tensor_parallel(config):
        return nn.Linear(input_size, output_size, bias=bias)
    return _built_after_plain_layer_draws(
        lambda: nn.Linear(input_size, output_size, bias=bias),
        lambda: RowParallelLinear(
            input_size,
            output_size,
            bias=bias,
            input_is_parallel=True,
            sequence_parallel=config.sequence_parallel,
        ),
    )


def word_embedding(config: ModelConfig) -> nn.Module:
    """nn.Embedding, or a VocabParallelEmbedding (its output is replicated, all-reduced)."""
    if not is_tensor_parallel(config):
        return nn.Embedding(config.padded_vocab_size, config.hidden_size)
    return _built_after_plain_layer_draws(
        lambda: nn.Embedding(config.padded_vocab_size, config.hidden_size),
        lambda: VocabParallelEmbedding(config.padded_vocab_size, config.hidden_size),
    )


def output_linear(config: ModelConfig) -> nn.Module:
    """The untied output layer [vocab, hidden], vocabulary rows split over TP ranks.

    GPTModel uses only its weight (the logits are `F.linear` with `output_weight()`, tied or
    not), so the parallel layer here is a holder of the shard and its init.
    """
    return column_parallel_linear(config, config.hidden_size, config.padded_vocab_size, bias=False)


def sharded_dropout_rng(enabled: bool) -> ContextManager:
    """Draw from the tracker's per-TP-rank stream when ``enabled``: dropout on a tensor that
    differs across TP ranks (a head or sequence shard) must not repeat one mask on every shard."""
    return model_parallel_rng_tracker().fork() if enabled else contextlib.nullcontext()
