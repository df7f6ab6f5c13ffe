"""Swapping a module's parameter tensors while keeping the parameters' marks.

The parallelize steps (megatron.parallelize.steps) cut a built layer down to this rank's shard, and
materialize a model built on the meta device. Both give a parameter a new tensor; the marks the
rest of the framework reads on it (tensor-parallel attributes, `sequence_parallel`, the expert
mark, `shared_embedding`) live in the Parameter's attributes and must survive the swap, which
`torch.nn.Module.to_empty` does not promise (it may create new Parameter objects without them).
"""

from __future__ import annotations

from typing import Union

import torch
from torch import nn


def replace_parameter(module: nn.Module, name: str, tensor: torch.Tensor) -> nn.Parameter:
    """Make `tensor` the data of `module`'s parameter `name`: a new Parameter with the old one's
    `requires_grad` and attributes; returns it."""
    old = module._parameters[name]
    new = nn.Parameter(tensor, requires_grad=old.requires_grad)
    new.__dict__.update(old.__dict__)
    module._parameters[name] = new
    return new


def materialize(module: nn.Module, device: Union[str, torch.device]) -> bool:
    """Give every parameter and buffer of `module` still on the meta device uninitialized
    storage on `device` (parameters keep their attributes); returns whether any was on meta.
    The caller then draws the weights (GPTModel.init_weights)."""
    found = False
    swapped: dict[int, nn.Parameter] = {}  # a parameter shared by two modules stays shared
    for submodule in module.modules():
        for name, param in list(submodule._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) in swapped:
                submodule._parameters[name] = swapped[id(param)]
            else:
                empty = torch.empty_like(param, device=device)
                swapped[id(param)] = replace_parameter(submodule, name, empty)
            found = True
        for name, buffer in list(submodule._buffers.items()):
            if buffer is not None and buffer.is_meta:
                submodule._buffers[name] = torch.empty_like(buffer, device=device)
                found = True
    return found
