"""What the trainer calls around its steps on behalf of model parts it does not know.

The trainer (megatron.training) is model-agnostic. An extension whose layers need work around
the training step subclasses `TrainingHooks` (moe.training_hooks: the expert weights' compute
copies, the expert-load log, the compile choice) and the entry point hands an instance to
`pretrain`. Every default does nothing, so a dense model passes none.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch
from torch import nn

from megatron.parallelize.data_parallel import DataParallel
from megatron.parallelize.steps import CompileChoice


class TrainingHooks:
    """Called by the trainer on every rank, in this order: `compile_choice` once, `setup` once,
    then per step `before_step`, `before_forwards` ... forwards (`before_layer_forward` in them,
    after `weights_arrive_by_layer`) and backwards ...
    `after_backwards`, `rerun_step` (the step may run again from `before_forwards`), and
    `iteration_fields` and `log` at each --log-interval."""

    def compile_choice(self, device: torch.device) -> CompileChoice:
        """How torch.compile compiles the model on `device`
        (megatron.parallelize.steps.CompileChoice): whether it may at all, and with which of the
        compile step's options."""
        return CompileChoice()

    def setup(self, model: nn.Module, data_parallel: DataParallel, device: torch.device) -> None:
        """Once, with the unwrapped model on `device` and the run's data-parallel mode
        (megatron.parallelize.data_parallel: whether torch DDP reduces the gradients, whose
        hooks then wait on autograd's accumulation)."""

    def before_step(self, model: nn.Module) -> bool:
        """At the start of each training step, before its first forward: whether this step
        may ask to run again (`rerun_step`; the extension then keeps what it needs for that,
        and the trainer its random state and micro-batches). False: it never asks."""
        return False

    def rerun_step(self, model: nn.Module) -> Optional[str]:
        """After `after_backwards` of a step `before_step` said may run again (a collective:
        every rank calls it, and all must answer alike): a note when the step's forwards and backwards must run again, before any
        gradient is reduced or stepped; the extension has already put back its own state and
        changed what made the step invalid. The trainer then restores the random generators of
        the step's start and replays its micro-batches. None: the step stands."""
        return None

    def before_forwards(self, model: nn.Module) -> None:
        """Before the first forward of each training step and of each evaluation: the
        optimizer step or a checkpoint load may have changed the weights since the last."""

    def weights_arrive_by_layer(self) -> None:
        """Once, before the first step, when the parameters of each transformer layer arrive
        only just before its forward (--overlap-param-gather): from then on `before_forwards`
        must not read the layers' weights, and `before_layer_forward` is called for each layer
        once its weights are there."""

    def before_layer_forward(self, layer: nn.Module) -> None:
        """Before each forward of a transformer layer, its weights there, after
        `weights_arrive_by_layer` (also for the forwards recomputed in the backward)."""

    def after_backwards(self, model: nn.Module) -> None:
        """After the last backward of a training step, before any gradient is reduced, clipped
        or stepped."""

    def iteration_fields(self, model: nn.Module) -> Dict[str, float]:
        """At each --log-interval, before the iteration line (a collective: every rank calls
        it): named numbers of the window for the end of that line and the dashboards, the same
        on every rank."""
        return {}

    def log(
        self,
        model: nn.Module,
        iteration: int,
        print_fn: Callable[[str], None],
        metric_writers: Optional[Any],
    ) -> Dict[str, Any]:
        """After the iteration line of each --log-interval (a collective: every rank calls it).
        Prints with `print_fn`, writes to `metric_writers` (a
        megatron.training.metric_writers.MetricWriters: TensorBoard, W&B; on the rank that
        writes, else None) and returns named records, which the trainer keeps in
        `TrainingResult.records` (one entry per window)."""
        return {}
