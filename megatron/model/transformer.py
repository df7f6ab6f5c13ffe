"""Pre-LN transformer layer and the decoder block of layers, with activation recomputation."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, ContextManager, Optional, Sequence, Tuple

import torch
from torch import nn

from megatron.model.attention import SelfAttention
from megatron.model.mlp import DENSE_MLP, MlpSpec
from megatron.model.norms import build_norm
from megatron.tensor_parallel import checkpoint

if TYPE_CHECKING:
    from megatron.config import ModelConfig

RotaryCosSin = Optional[Tuple[torch.Tensor, torch.Tensor]]


class DefaultRandom(nn.Module):
    """Where a block's layers draw their random numbers (dropout masks, noise): the default
    generator. A parameterless part; sequence parallelism swaps it for the tensor-parallel
    rank's stream (megatron.tensor_parallel.parts.PerRankRandomScope)."""

    def scope(self) -> ContextManager:
        return contextlib.nullcontext()


class TransformerLayer(nn.Module):
    """x + dropout(attention(norm(x))), then x + dropout(mlp(norm(x))), on [b, s, h]
    ([b, s / tp, h] with sequence parallelism)."""

    def __init__(
        self, config: ModelConfig, layer_number: int, mlp_spec: MlpSpec = DENSE_MLP
    ) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.input_layernorm = build_norm(config)
        self.self_attention = SelfAttention(config, layer_number)
        self.pre_mlp_layernorm = build_norm(config)
        self.mlp = mlp_spec.build(config, layer_number)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self, hidden_states: torch.Tensor, rotary_cos_sin: RotaryCosSin = None
    ) -> torch.Tensor:
        """[b, s, h] -> [b, s, h]."""
        attention_output = self.self_attention(self.input_layernorm(hidden_states), rotary_cos_sin)
        hidden_states = hidden_states + self.hidden_dropout(attention_output)
        mlp_output = self.mlp(self.pre_mlp_layernorm(hidden_states))
        return hidden_states + self.hidden_dropout(mlp_output)


RECOMPUTE_METHODS = ("uniform", "block")


class TransformerBlock(nn.Module):
    """`num_layers` TransformerLayers and the final norm; a pipeline stage holds the layers
    numbered `layer_numbers` (global, 0-based) and the final norm only when it is the last.

    Full recompute (training only; switched on by `set_full_recompute`, which
    megatron.parallelize.steps calls for `recompute_granularity="full"`) keeps just the inputs of
    checkpointed layers and re-runs their forward in backward:
      "uniform": layers in chunks of `recompute_num_layers`, one checkpoint per chunk;
      "block":   each of the first `recompute_num_layers` layers checkpointed, the rest not.
    Selective recompute lives in SelfAttention (only the core attention is re-run).

    The layers draw their random numbers inside `random_source.scope()`: the default generator
    as built, the same on every tensor-parallel rank for the replicated residual stream. Under
    sequence parallelism every dropout in the block acts on this rank's sequence shard, and the
    swapped-in part makes the whole block draw from the rank's stream (as Megatron does); the
    checkpoint's recompute replays those streams (megatron.tensor_parallel.checkpoint).
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_numbers: Optional[Sequence[int]] = None,
        final_norm: bool = True,
        mlp_spec: MlpSpec = DENSE_MLP,
    ) -> None:
        super().__init__()
        if layer_numbers is None:
            layer_numbers = range(config.num_layers)
        self.layers = nn.ModuleList(TransformerLayer(config, i, mlp_spec) for i in layer_numbers)
        self.final_layernorm = build_norm(config) if final_norm else None
        self.random_source: nn.Module = DefaultRandom()

        self.recompute_full = False
        self.recompute_method: Optional[str] = None
        self.recompute_num_layers: Optional[int] = None

    def set_full_recompute(self, method: Optional[str], num_layers: Optional[int]) -> None:
        """Checkpoint layers in training forwards by `method` ("uniform" or "block") and
        `num_layers` (see the class docstring)."""
        if method not in RECOMPUTE_METHODS:
            raise ValueError(
                f"recompute_granularity='full' needs recompute_method in {RECOMPUTE_METHODS},"
                f" got {method!r}; set --recompute-method"
            )
        if not num_layers or num_layers < 1:
            raise ValueError(
                "recompute_granularity='full' needs recompute_num_layers >= 1, got "
                f"{num_layers!r}; set --recompute-num-layers"
            )
        self.recompute_full = True
        self.recompute_method = method
        self.recompute_num_layers = num_layers

    def _run_layers(
        self, start: int, end: int, hidden_states: torch.Tensor, rotary_cos_sin: RotaryCosSin
    ) -> torch.Tensor:
        for layer in self.layers[start:end]:
            hidden_states = layer(hidden_states, rotary_cos_sin)
        return hidden_states

    def _checkpointed(
        self, start: int, end: int, hidden_states: torch.Tensor, rotary_cos_sin: RotaryCosSin
    ) -> torch.Tensor:
        # Non-reentrant: works with inputs that do not require grad and with autograd.grad;
        # RNG state is restored on recompute, so dropout masks match the first forward (the
        # default generator by torch, the tensor-parallel tracker's streams by the checkpoint).
        return checkpoint(self._run_layers, start, end, hidden_states, rotary_cos_sin)

    def forward(
        self, hidden_states: torch.Tensor, rotary_cos_sin: RotaryCosSin = None
    ) -> torch.Tensor:
        """[b, s, h] -> final-normalized [b, s, h] (sequence shards under sequence parallel;
        not normalized on a pipeline stage before the last)."""
        with self.random_source.scope():
            hidden_states = self._run_all_layers(hidden_states, rotary_cos_sin)
        if self.final_layernorm is None:
            return hidden_states
        return self.final_layernorm(hidden_states)

    def _run_all_layers(
        self, hidden_states: torch.Tensor, rotary_cos_sin: RotaryCosSin
    ) -> torch.Tensor:
        num_layers = len(self.layers)
        if not (self.recompute_full and self.training):
            hidden_states = self._run_layers(0, num_layers, hidden_states, rotary_cos_sin)
        elif self.recompute_method == "uniform":
            for start in range(0, num_layers, self.recompute_num_layers):
                end = min(start + self.recompute_num_layers, num_layers)
                hidden_states = self._checkpointed(start, end, hidden_states, rotary_cos_sin)
        else:  # "block"
            for index in range(num_layers):
                if index < self.recompute_num_layers:
                    hidden_states = self._checkpointed(
                        index, index + 1, hidden_states, rotary_cos_sin
                    )
                else:
                    hidden_states = self._run_layers(
                        index, index + 1, hidden_states, rotary_cos_sin
                    )
        return hidden_states
