"""Where the first rank's dashboard scalars go: TensorBoard (--tensorboard-dir), Weights & Biases
(--wandb-project), both, or neither.

The loop and the training hooks (megatron.training.hooks) call one `MetricWriters`, which hands
every call to each writer the flags asked for, so they all receive the same scalars.
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Optional, Protocol, Sequence

import torch

from megatron.config import Config
from megatron.training.logging import VALIDATION_SUFFIX, IterationStats, TensorBoardLogger
from megatron.training.wandb_logger import WandbLogger


class MetricWriter(Protocol):
    """What a dashboard writer takes (megatron.training.logging.TensorBoardLogger,
    megatron.training.wandb_logger.WandbLogger)."""

    def log_training(self, stats: IterationStats) -> None: ...

    def log_validation(
        self,
        losses: Dict[str, float],
        iteration: int,
        consumed_samples: int,
        split_suffix: str = VALIDATION_SUFFIX,
    ) -> None: ...

    def log_arguments(self, arguments: argparse.Namespace, iteration: int) -> None: ...

    def log_histogram(self, name: str, values: torch.Tensor, iteration: int) -> None: ...

    def log_scalars(self, scalars: Dict[str, float], iteration: int) -> None: ...

    def close(self) -> None: ...


class MetricWriters:
    """Every configured writer behind one writer's methods, each call handed to all in turn."""

    def __init__(self, writers: Sequence[MetricWriter]) -> None:
        self.writers: List[MetricWriter] = list(writers)

    def log_training(self, stats: IterationStats) -> None:
        """One --log-interval window's scalars (megatron.training.logging.training_scalars)."""
        for writer in self.writers:
            writer.log_training(stats)

    def log_validation(
        self,
        losses: Dict[str, float],
        iteration: int,
        consumed_samples: int,
        split_suffix: str = VALIDATION_SUFFIX,
    ) -> None:
        """One evaluation's losses and perplexities at `iteration`, named `<loss><split_suffix>`
        (megatron.training.logging: VALIDATION_SUFFIX, or TEST_SUFFIX for the test split's)."""
        for writer in self.writers:
            writer.log_validation(losses, iteration, consumed_samples, split_suffix)

    def log_arguments(self, arguments: argparse.Namespace, iteration: int) -> None:
        """The run's arguments, once at start-up."""
        for writer in self.writers:
            writer.log_arguments(arguments, iteration)

    def log_histogram(self, name: str, values: torch.Tensor, iteration: int) -> None:
        """The distribution of `values` at `iteration`."""
        for writer in self.writers:
            writer.log_histogram(name, values, iteration)

    def log_scalars(self, scalars: Dict[str, float], iteration: int) -> None:
        """Named scalars at `iteration` (those the training hooks add)."""
        for writer in self.writers:
            writer.log_scalars(scalars, iteration)

    def close(self) -> None:
        """Flush and close every writer."""
        for writer in self.writers:
            writer.close()


def open_metric_writers(config: Config, is_first_rank: bool) -> Optional[MetricWriters]:
    """The writers the flags ask for, opened on the first rank (the one that writes, as in
    Megatron's TensorBoard); None on the other ranks and when no flag asks for one."""
    if not is_first_rank or not config.logging.writes_metrics:
        return None
    logging = config.logging
    writers: List[MetricWriter] = []
    if logging.tensorboard_dir:
        writers.append(TensorBoardLogger(logging.tensorboard_dir, logging.tensorboard_queue_size))
    if logging.wandb_project:
        writers.append(WandbLogger(logging, config.checkpoint.save, config.arguments))
    return MetricWriters(writers)
