"""The model and optimizer tensors this rank saves into, and loads from, a sharded checkpoint.

Global names are those of a single-process run:

    model.<state-dict name>                     the model's parameters and persistent buffers
    optimizer.state.<parameter name>.<key>      per-element optimizer state (Adam's exp_avg,
                                                exp_avg_sq; SGD's momentum_buffer), shaped like
                                                the parameter
    optimizer.scalar.<parameter name>.<key>     a parameter's scalar state (Adam's step), [1]

so a checkpoint says nothing of the layout that wrote it. Under pipeline parallelism a stage's
names are the single-process ones (megatron.pipeline.stages.full_name) and the last stage's copy
of tied word embeddings is not saved; it loads the first stage's table. A tensor every tensor-
parallel rank holds the same is written by tensor-parallel rank 0 only; replicas over data
parallelism write the same chunks, which DCP writes once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from torch import nn

from megatron.checkpointing.chunks import (
    ChunkedTensor,
    chunks_like,
    flat_range_chunks,
    is_replicated_over_tensor_parallel,
)
from megatron.optimizer.optimizer import MegatronOptimizer
from megatron.parallel import parallel_state
from megatron.pipeline.stages import WORD_EMBEDDINGS_KEY, full_name, holds_stage_chunks

MODEL_PREFIX = "model."
STATE_PREFIX = "optimizer.state."
SCALAR_PREFIX = "optimizer.scalar."


def named_model_tensors(model: nn.Module) -> Iterator[Tuple[Optional[str], torch.Tensor]]:
    """(single-process name, tensor) of every entry of this rank's state dict; the name is
    None for the last stage's copy of tied word embeddings."""
    return _with_full_names(model, lambda chunk: chunk.state_dict(keep_vars=True).items())


def named_parameters(model: nn.Module) -> Iterator[Tuple[Optional[str], torch.Tensor]]:
    """(single-process name, parameter) of every parameter of this rank's model."""
    return _with_full_names(model, lambda chunk: chunk.named_parameters())


def _with_full_names(
    model: nn.Module, items: Callable[[nn.Module], Iterable[Tuple[str, torch.Tensor]]]
) -> Iterator[Tuple[Optional[str], torch.Tensor]]:
    if not holds_stage_chunks(model):
        yield from items(model)
        return
    for chunk in model:  # this rank's stage chunks
        for name, tensor in items(chunk):
            yield full_name(chunk, name), tensor


def model_tensors_to_save(model: nn.Module) -> Dict[str, ChunkedTensor]:
    """This rank's chunks of the model's tensors, as the checkpoint names them."""
    writes_replicated = parallel_state.get_tensor_model_parallel_rank() == 0
    tensors = {}
    for name, tensor in named_model_tensors(model):
        if name is None:  # the last stage's copy of tied embeddings: the first stage saves it
            continue
        if not writes_replicated and is_replicated_over_tensor_parallel(tensor):
            continue
        tensors[MODEL_PREFIX + name] = chunks_like(tensor, tensor)
    return tensors


def model_tensors_to_load(model: nn.Module) -> Dict[str, ChunkedTensor]:
    """Where each stored model tensor's chunks go: views of this rank's own tensors."""
    tensors: Dict[str, ChunkedTensor] = {}
    for name, tensor in named_model_tensors(model):
        _merge(
            tensors, MODEL_PREFIX + (name or WORD_EMBEDDINGS_KEY), chunks_like(tensor, tensor.data)
        )
    return tensors


@dataclass(frozen=True)
class StateHolder:
    """One parameter of the inner torch optimizer: a model parameter, or the distributed
    optimizer's flat piece of one starting at element `flat_start` of it."""

    name: Optional[str]  # the model parameter's single-process name; None: a tied copy
    param: torch.Tensor  # the model parameter (its attributes say how it is split)
    key: torch.Tensor  # what the inner optimizer's state is keyed by
    flat_start: Optional[int]

    def chunks(self, value: torch.Tensor) -> ChunkedTensor:
        """A per-element state `value` of this holder as chunks of the single-process one."""
        if self.flat_start is None:
            return chunks_like(self.param, value)
        return flat_range_chunks(self.param, value, self.flat_start)


def state_holders(optimizer: Any, model: nn.Module) -> List[StateHolder]:
    """The inner optimizer's parameters in its own numbering (its param groups in order)."""
    names = {id(param): name for name, param in named_parameters(model)}
    if isinstance(optimizer, MegatronOptimizer):
        return [
            StateHolder(names[id(param)], param, key, flat_start)
            for param, key, flat_start in optimizer.state_pieces()
        ]
    return [
        StateHolder(names[id(param)], param, param, None)
        for group in optimizer.param_groups
        for param in group["params"]
    ]


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer holding the state: a MegatronOptimizer's, or `optimizer` itself."""
    return optimizer.optimizer if isinstance(optimizer, MegatronOptimizer) else optimizer


def optimizer_tensors_to_save(optimizer: Any, model: nn.Module) -> Dict[str, ChunkedTensor]:
    """This rank's chunks of the optimizer's per-parameter state, as the checkpoint names them."""
    writes_replicated = parallel_state.get_tensor_model_parallel_rank() == 0
    tensors = {}
    for holder in state_holders(optimizer, model):
        state = inner_optimizer(optimizer).state.get(holder.key)
        if holder.name is None or not state:
            continue
        if not writes_replicated and is_replicated_over_tensor_parallel(holder.param):
            continue
        for key, value in state.items():
            prefix = state_prefix(value, holder.key.shape)
            if prefix == STATE_PREFIX:
                tensors[f"{prefix}{holder.name}.{key}"] = holder.chunks(value)
            elif prefix == SCALAR_PREFIX:
                tensors[f"{prefix}{holder.name}.{key}"] = ChunkedTensor(
                    torch.Size([1]), [((0,), value.detach().reshape(1))]
                )
    return tensors


def state_prefix(value: Any, shape: torch.Size) -> Optional[str]:
    """How an optimizer state `value` of a parameter shaped `shape` is stored: per element
    (STATE_PREFIX), as a scalar (SCALAR_PREFIX), or not at all (None: not a tensor)."""
    if not torch.is_tensor(value):
        return None
    if value.dim() > 0 and value.shape == shape:
        return STATE_PREFIX
    return SCALAR_PREFIX if value.numel() == 1 else None


def stored_optimizer_keys(names: Iterable[str]) -> Dict[str, List[Tuple[str, str]]]:
    """The stored optimizer state per parameter: {parameter name: [(prefix, key), ...]} from
    the checkpoint's tensor names."""
    keys_by_name: Dict[str, List[Tuple[str, str]]] = {}
    for fqn in names:
        for prefix in (STATE_PREFIX, SCALAR_PREFIX):
            if fqn.startswith(prefix):
                name, key = fqn[len(prefix) :].rsplit(".", 1)
                keys_by_name.setdefault(name, []).append((prefix, key))
    return keys_by_name


def optimizer_state_to_load(
    optimizer: Any, model: nn.Module, stored: Dict[str, Any]
) -> Tuple[Dict[int, Dict[str, torch.Tensor]], Dict[str, ChunkedTensor]]:
    """Empty state tensors for the inner optimizer, in its numbering, and where each stored
    tensor's chunks go in them. `stored` maps the checkpoint's tensor names to their DCP
    metadata (the stored dtype is kept: the torch optimizer casts on load)."""
    keys_by_name = stored_optimizer_keys(stored)
    state: Dict[int, Dict[str, torch.Tensor]] = {}
    targets: Dict[str, ChunkedTensor] = {}
    for index, holder in enumerate(state_holders(optimizer, model)):
        name = holder.name or WORD_EMBEDDINGS_KEY
        entry = {}
        for prefix, key in keys_by_name.get(name, []):
            fqn = f"{prefix}{name}.{key}"
            dtype = stored[fqn].properties.dtype
            if prefix == STATE_PREFIX:
                # Shaped, placed and (a DTensor under FSDP2) sharded like its parameter.
                value = torch.empty_like(holder.key, dtype=dtype)
                _merge(targets, fqn, holder.chunks(value))
            else:
                value = torch.empty((), dtype=dtype)
                _merge(targets, fqn, ChunkedTensor(torch.Size([1]), [((0,), value.view(1))]))
            entry[key] = value
        if entry:
            state[index] = entry
    return state, targets


def _merge(tensors: Dict[str, ChunkedTensor], name: str, chunked: ChunkedTensor) -> None:
    if name in tensors:
        tensors[name].chunks.extend(chunked.chunks)
    else:
        tensors[name] = chunked
