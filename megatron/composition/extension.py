"""What a package built on megatron adds to a GPT run, as one object (the role torchtitan's
`TrainSpec` plays for a model): its flags, its frozen config section, the MLP its layers use,
the work it does around the steps, the loss terms it adds, the saved arguments that define
its part of the model, and those that only choose its kernels. The MoE layers are one (moe.extension.MOE_EXTENSION); megatron never
imports them: the run's composition (megatron.composition.run.RunComposition) is handed the
extensions by whoever composes a run (gpt_pretraining).

Each builder after `build_config` receives the extension's own config section (never None: a
run without that section does not call them) and the run's Config.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from megatron.config import Config
from megatron.config.sections import ExtensionBuilder
from megatron.model import MlpSpec
from megatron.training.hooks import TrainingHooks

# auxiliary_losses(model) after each forward of `model` (a pipeline stage's chunk, or the whole
# model): {reported name: loss term}, each added to the loss.
AuxiliaryLosses = Callable[[nn.Module], Dict[str, torch.Tensor]]


@dataclass(frozen=True)
class RunExtension:
    """A package's part of a GPT run. `config_type` is the type `build_config` returns (None when
    the flags do not ask for the extension); the run finds the section with
    `config.extension(config_type)`."""

    name: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    build_config: ExtensionBuilder
    config_type: type
    model_arguments: Tuple[str, ...]
    mlp_spec: Callable[[Any, Config], MlpSpec]
    training_hooks: Callable[[Any, Config], TrainingHooks]
    auxiliary_losses: Callable[[Any, Config, nn.Module], AuxiliaryLosses]
    notes: Callable[[Any], List[str]]
    # Flags that choose kernels for the saving run's devices, not the model: a checkpoint's saved
    # config takes their defaults, so that a process reading it on another device (a tool on a
    # CPU, generation) chooses its own rather than refusing the run's.
    kernel_arguments: Tuple[str, ...] = ()
    # Fills the extension's settings the flags left unset, in place, and returns the notes to
    # print (ConfigError for a bad combination): called on the resolved flags, and on a
    # checkpoint's saved arguments, so that the arguments printed and saved hold the values the
    # run uses. Applying it twice changes nothing.
    resolve_arguments: Optional[Callable[[argparse.Namespace], List[str]]] = None
