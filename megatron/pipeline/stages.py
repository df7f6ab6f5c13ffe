"""Pipeline stages of the GPT model: which layers each holds, their names, and the tied word
embeddings across them (megatron.parallelize.steps.split_pipeline cuts the model by these rules).

Megatron's split: with P stages each holds ``num_layers / P`` consecutive layers, stage r the
layers from ``r * num_layers / P``. With the interleaved schedule (V virtual stages per rank,
``N = num_layers / (P * V)`` layers each) chunk v of rank r holds the N layers from
``v * num_layers / V + r * N``, so the model's layers go round the ranks V times. The first
stage (rank 0, chunk 0) also holds the embedding; the last (rank P - 1, chunk V - 1) the final
norm and the output layer, and computes the loss.

A stage's module keeps its layers at local indices (``decoder.layers.0`` ...); checkpoints use
the single-process names, which `stage_to_full_names` and `full_to_stage_state_dict` map to and
from.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional

import torch
from torch import nn

from megatron.model import GPTModel
from megatron.parallel import parallel_state

_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.")
WORD_EMBEDDINGS_KEY = "embedding.word_embeddings.weight"
OUTPUT_LAYER_KEY = "output_layer.weight"


def check_pipeline_sizes(
    num_layers: int, pipeline_size: int, virtual_size: Optional[int] = None
) -> None:
    """Raise ValueError, naming the numbers, when the layers do not split evenly."""
    chunks = pipeline_size * (virtual_size or 1)
    if num_layers % chunks != 0:
        detail = f" x {virtual_size} virtual stages" if virtual_size else ""
        raise ValueError(
            f"--num-layers {num_layers} is not divisible by {pipeline_size} pipeline stages"
            f"{detail} (= {chunks} model chunks); every chunk must hold the same number of layers"
        )


def stage_layer_numbers(
    num_layers: int,
    pipeline_size: int,
    pipeline_rank: int,
    virtual_size: Optional[int] = None,
    virtual_rank: Optional[int] = None,
) -> range:
    """Global numbers of the layers of stage `pipeline_rank` (its chunk `virtual_rank` when
    interleaving); see the module docstring for the split."""
    check_pipeline_sizes(num_layers, pipeline_size, virtual_size)
    if virtual_size is None:
        per_stage = num_layers // pipeline_size
        return range(pipeline_rank * per_stage, (pipeline_rank + 1) * per_stage)
    per_chunk = num_layers // (pipeline_size * virtual_size)
    first = (virtual_rank or 0) * (num_layers // virtual_size) + pipeline_rank * per_chunk
    return range(first, first + per_chunk)


def full_name(chunk: GPTModel, name: str) -> Optional[str]:
    """The single-process name of `chunk`'s tensor `name` (global layer number); None for the
    last stage's copy of tied word embeddings (the first stage's table is the one saved)."""
    if name == OUTPUT_LAYER_KEY and _holds_embedding_copy(chunk):
        return None
    match = _LAYER_KEY.match(name)
    if match is None:
        return name
    number = chunk.decoder.layers[int(match.group(1))].layer_number
    return f"decoder.layers.{number}.{name[match.end() :]}"


def stage_to_full_names(state: Dict[str, torch.Tensor], chunk: GPTModel) -> Dict[str, torch.Tensor]:
    """A chunk's state dict under single-process names (see `full_name`)."""
    renamed = {}
    for name, tensor in state.items():
        global_name = full_name(chunk, name)
        if global_name is not None:
            renamed[global_name] = tensor
    return renamed


def full_to_stage_state_dict(
    full_state: Dict[str, torch.Tensor], chunk: GPTModel
) -> Dict[str, torch.Tensor]:
    """The entries of a single-process state dict that `chunk` holds, under its own names."""
    stage_state = {}
    numbers = {layer.layer_number: index for index, layer in enumerate(chunk.decoder.layers)}
    wanted = set(chunk.state_dict().keys())
    for name, tensor in full_state.items():
        match = _LAYER_KEY.match(name)
        if match is not None:
            local = numbers.get(int(match.group(1)))
            if local is None:
                continue
            name = f"decoder.layers.{local}.{name[match.end() :]}"
        if name in wanted:
            stage_state[name] = tensor
    if _holds_embedding_copy(chunk):
        stage_state[OUTPUT_LAYER_KEY] = full_state[WORD_EMBEDDINGS_KEY]
    return stage_state


def holds_stage_chunks(model: nn.Module) -> bool:
    """Whether `model` is this rank's pipeline stage chunks (an nn.ModuleList of GPTModels:
    megatron.parallelize.steps.ParallelModel.unwrapped under a pipeline) rather than one
    whole model: the layout's answer to "is this a pipeline run", read off the model."""
    return isinstance(model, nn.ModuleList)


def _holds_embedding_copy(chunk: GPTModel) -> bool:
    return chunk.output_layer is not None and getattr(
        chunk.output_layer.weight, "shared_embedding", False
    )


def tied_embedding_weights(chunks: List[GPTModel]) -> List[torch.Tensor]:
    """The copies of tied word embeddings this rank holds that live on two stages: the first
    stage's table and the last stage's output weight (none on middle stages, or when the
    first stage is also the last)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return []
    weights = []
    for chunk in chunks:
        if chunk.config.untie_embeddings_and_output_weights:
            continue
        if chunk.embedding is not None:
            weights.append(chunk.embedding.word_embeddings.weight)
        if _holds_embedding_copy(chunk):
            weights.append(chunk.output_layer.weight)
    return weights
