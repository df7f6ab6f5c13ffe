"""Megatron's dashboard scalars in Weights & Biases (--wandb-project, Megatron-LM's flags).

`WandbLogger` takes the calls `TensorBoardLogger` takes and logs the same names and values
(megatron.training.logging) with the iteration as W&B's step; there is no `... vs samples`
twin of each scalar, whose x axis W&B cannot vary: `samples vs steps`, Megatron-LM's W&B
scalar, serves as that axis instead.

A resumed run continues its W&B run: the run's id is kept in <--save>/wandb_run_id.txt, and a
run that finds one there asks W&B for that run back (resume="allow"). A new --save starts a new
W&B run.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Dict, Mapping, Optional

import torch

from megatron.config import LoggingConfig
from megatron.training.logging import (
    VALIDATION_SUFFIX,
    IterationStats,
    training_scalars,
    validation_scalars,
)

RUN_ID_FILE = "wandb_run_id.txt"


def wandb_directory(logging: LoggingConfig, save: Optional[str]) -> Optional[str]:
    """Where W&B keeps its local files (it adds a `wandb/` folder there): --wandb-save-dir, else
    <--save>/wandb as in Megatron-LM, else None for W&B's own default (the working directory)."""
    if logging.wandb_save_dir:
        return logging.wandb_save_dir
    return os.path.join(save, "wandb") if save else None


def read_run_id(save: str) -> Optional[str]:
    """The W&B run id an earlier run with this --save kept, or None."""
    path = os.path.join(save, RUN_ID_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as file:
        return file.read().strip() or None


def write_run_id(save: str, run_id: str) -> None:
    """Keep `run_id` in --save for the run that resumes from it; a temporary file renamed into
    place, so that a run killed while writing never leaves half an id to resume."""
    os.makedirs(save, exist_ok=True)
    path = os.path.join(save, RUN_ID_FILE)
    temporary = f"{path}.tmp"
    with open(temporary, "w") as file:
        file.write(run_id + "\n")
    os.replace(temporary, path)


class WandbLogger:
    """One W&B run of the training: TensorBoardLogger's methods, the iteration as the step.

    `arguments` (the resolved flags) become the run's config, as Megatron-LM's do; `save` is
    --save, where the run id is kept (None: every start is a new W&B run).
    """

    def __init__(
        self, logging: LoggingConfig, save: Optional[str], arguments: Mapping[str, Any]
    ) -> None:
        import wandb  # an optional dependency: runs without --wandb-project never import it

        self._wandb = wandb
        directory = wandb_directory(logging, save)
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
        run_id = read_run_id(save) if save else None
        self._run = wandb.init(
            project=logging.wandb_project,
            entity=logging.wandb_entity or None,
            name=logging.wandb_exp_name or None,
            dir=directory,
            id=run_id,
            resume="allow" if run_id else None,
        )
        # A resumed run's flags differ from those its W&B run started with (--load at least).
        self._run.config.update(dict(arguments), allow_val_change=True)
        if save:
            write_run_id(save, self._run.id)

    @property
    def run_id(self) -> str:
        """The W&B run's id (the same for every part of a resumed run)."""
        return self._run.id

    def log_training(self, stats: IterationStats) -> None:
        scalars = training_scalars(stats)
        scalars["samples vs steps"] = stats.consumed_samples
        self._run.log(scalars, step=stats.iteration)

    def log_validation(
        self,
        losses: Dict[str, float],
        iteration: int,
        consumed_samples: int,
        split_suffix: str = VALIDATION_SUFFIX,
    ) -> None:
        self._run.log(validation_scalars(losses, split_suffix), step=iteration)

    def log_arguments(self, arguments: argparse.Namespace, iteration: int) -> None:
        """Nothing: the run's config already holds the arguments (set when it was opened)."""

    def log_histogram(self, name: str, values: torch.Tensor, iteration: int) -> None:
        histogram = self._wandb.Histogram(values.detach().float().cpu().numpy())
        self._run.log({name: histogram}, step=iteration)

    def log_scalars(self, scalars: Dict[str, float], iteration: int) -> None:
        self._run.log(dict(scalars), step=iteration)

    def close(self) -> None:
        self._run.finish()
