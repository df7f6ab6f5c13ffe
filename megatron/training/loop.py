"""The training loop: iterations, Megatron's log lines, evaluation and saving on schedule, exits.

The train step itself, evaluation and checkpoints are the `Trainer`'s (megatron.training.trainer).
`pretrain` is model-agnostic: the entry point (pretrain_gpt.py) hands it a model with parallelism
applied (megatron.parallelize.steps), datasets and a `forward_step(model, batch) -> (loss, reported)`
function, where `reported` maps log names such as "lm loss" to detached scalars averaged over
micro-batches and data-parallel ranks for the log.
"""

from __future__ import annotations

import signal
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.checkpointing.model_arguments import MODEL_ARGUMENTS
from megatron.config import Config
from megatron.data.loader import build_data_iterator
from megatron.errors import TrainingDiverged
from megatron.initialize import DistributedContext, print_rank_0
from megatron.parallelize.steps import ParallelModel
from megatron.training.hooks import TrainingHooks
from megatron.training.logging import (
    TEST_SUFFIX,
    VALIDATION_SUFFIX,
    IterationStats,
    format_compile_report,
    format_iteration_line,
    format_memory_report,
    format_validation_block,
)
from megatron.training.memory_history import dump_memory_snapshot
from megatron.training.profiling import StepProfiler
from megatron.training.trainer import ForwardStep, Trainer


@dataclass
class TrainingResult:
    """What a run did: per-iteration reported losses (for tests and tools) and how it ended."""

    iteration: int = 0
    consumed_train_samples: int = 0
    losses: List[Dict[str, float]] = field(default_factory=list)
    validation: List[Tuple[str, Dict[str, float]]] = field(default_factory=list)
    # What the training hooks logged, one entry per --log-interval window under each name
    # (megatron.training.hooks), e.g. "expert load" of an MoE model.
    records: Dict[str, List[Any]] = field(default_factory=dict)
    skipped_iterations: int = 0
    exit_reason: Optional[str] = None


def total_train_iters(config: Config) -> int:
    """--train-iters, or --train-samples in whole global batches (no batch-size ramp-up)."""
    training = config.training
    if training.train_iters is not None:
        return training.train_iters
    return training.train_samples // training.global_batch_size


class _ExitSignal:
    """SIGTERM sets a flag; every rank agrees to stop at the same iteration (Megatron's handler)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.received = False
        if enabled:
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def any_rank_received(self, device: torch.device) -> bool:
        if not self.enabled:
            return False
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _throughput(trainer: Trainer, seconds_per_iteration: float) -> Tuple[float, float, float]:
    config, world_size = trainer.config, trainer.context.world_size
    tokens = config.training.global_batch_size * config.data.seq_length
    tokens_per_second = tokens / seconds_per_iteration
    tflops_per_gpu = trainer.flops_per_iteration / seconds_per_iteration / world_size / 1e12
    return tokens_per_second, tokens_per_second / world_size, tflops_per_gpu


def _validate(
    trainer: Trainer,
    iterator,
    prefix: str,
    result: TrainingResult,
    advance_consumed: bool,
    split_suffix: str = VALIDATION_SUFFIX,
) -> None:
    config = trainer.config
    losses = trainer.evaluate(iterator, config.training.eval_iters)
    if advance_consumed:
        trainer.consumed_valid_samples += (
            config.training.eval_iters * config.training.global_batch_size
        )
    print_rank_0(format_validation_block(prefix, losses))
    result.validation.append((prefix, losses))
    if trainer.metric_writers is not None:
        trainer.metric_writers.log_validation(
            losses, trainer.iteration, trainer.consumed_train_samples, split_suffix
        )


def train(trainer: Trainer, train_iterator, valid_iterator, result: TrainingResult) -> None:
    """Run iterations until --train-iters or an exit condition; log, evaluate and save on schedule."""
    profiler = StepProfiler(trainer.config.logging, trainer.context.rank, trainer.context.device)
    try:
        _train_loop(trainer, train_iterator, valid_iterator, result, profiler)
        # The last step's parameters, in full, for whatever reads the model after training.
        trainer.data_parallel.finish_parameter_gather()
    except TrainingDiverged:
        # A checkpoint of an earlier iteration still being written is good: it completes.
        trainer.finish_saves()
        raise
    finally:
        profiler.stop()  # a run that ends before --profile-step-end still writes its trace


@dataclass
class _LogWindow:
    """The iterations since the last log line: what Megatron's line reports of them (losses
    averaged over the iterations that advanced; skipped and non-finite ones counted) and their
    time, which leaves out evaluations and checkpoint saves (`paused`), as Megatron stops its
    interval timer around them: the logged time per iteration is training's alone."""

    start: float = field(default_factory=time.time)
    iterations: int = 0
    advanced: int = 0
    skipped: int = 0
    nan: int = 0
    loss_sums: Dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add(self, losses: Dict[str, float], skipped: bool, got_nan: bool) -> None:
        self.iterations += 1
        # Megatron's count: iterations whose loss (or here gradient norm) was not finite.
        self.nan += int(got_nan)
        if skipped:
            self.skipped += 1
            return
        self.advanced += 1
        for name, value in losses.items():
            self.loss_sums[name] += value

    def seconds_per_iteration(self) -> float:
        return (time.time() - self.start) / self.iterations

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the time spent in the `with` block out of the window."""
        started = time.time()
        try:
            yield
        finally:
            self.start += time.time() - started

    def mean_losses(self) -> Dict[str, float]:
        return {name: value / max(self.advanced, 1) for name, value in self.loss_sums.items()}


def _train_loop(
    trainer: Trainer, train_iterator, valid_iterator, result: TrainingResult, profiler: StepProfiler
) -> None:
    config = trainer.config
    training, logging_config = config.training, config.logging
    exit_signal = _ExitSignal(training.exit_signal_handler)
    start_time = time.time()
    window = _LogWindow()
    last_grad_norm: Optional[float] = None
    # Once, after the first logged iteration, as Megatron does; with what torch.compile made.
    report_memory = True
    trainer.model.train()
    print_rank_0("training ...")
    train_iters = total_train_iters(config)
    while trainer.iteration < train_iters:
        trainer.mark_progress(f"iteration {trainer.iteration + 1}")
        profiler.before_step(trainer.iteration)
        losses, skipped, grad_norm, got_nan = trainer.train_step(train_iterator)
        trainer.iteration += 1
        profiler.after_step(trainer.iteration)
        trainer.consumed_train_samples += training.global_batch_size
        result.losses.append(losses)
        window.add(losses, skipped, got_nan)
        if skipped:
            result.skipped_iterations += 1
        else:
            last_grad_norm = grad_norm

        if trainer.iteration % logging_config.log_interval == 0:
            if trainer.context.device.type == "cuda":
                torch.cuda.synchronize()
            seconds_per_iteration = window.seconds_per_iteration()
            tokens_per_second, tokens_per_gpu, tflops = _throughput(trainer, seconds_per_iteration)
            stats = IterationStats(
                iteration=trainer.iteration,
                train_iters=train_iters,
                consumed_samples=trainer.consumed_train_samples,
                elapsed_ms_per_iteration=seconds_per_iteration * 1000.0,
                learning_rate=trainer.optimizer.param_groups[0]["lr"],
                global_batch_size=training.global_batch_size,
                losses=window.mean_losses(),
                loss_scale=trainer.optimizer.loss_scale,
                grad_norm=last_grad_norm,
                skipped_iterations=window.skipped,
                nan_iterations=window.nan,
                tokens_per_second=tokens_per_second,
                tokens_per_second_per_gpu=tokens_per_gpu,
                tflops_per_gpu=tflops,
                extra=trainer.hooks.iteration_fields(trainer.unwrapped_model),
            )
            print_rank_0(format_iteration_line(stats))
            dump_memory_snapshot(logging_config, trainer.context)
            if report_memory and trainer.context.device.type == "cuda":
                print_rank_0(
                    format_memory_report(
                        trainer.context.rank, trainer.iteration, trainer.context.device
                    )
                )
                compiled = format_compile_report(trainer.iteration)
                if compiled is not None:
                    print_rank_0(compiled)
                report_memory = False
            if trainer.metric_writers is not None:
                trainer.metric_writers.log_training(stats)
            records = trainer.hooks.log(
                trainer.unwrapped_model, trainer.iteration, print_rank_0, trainer.metric_writers
            )
            for name, record in records.items():
                result.records.setdefault(name, []).append(record)
            window = _LogWindow()

        if (
            valid_iterator is not None
            and training.eval_interval
            and trainer.iteration % training.eval_interval == 0
        ):
            with window.paused():
                _validate(
                    trainer,
                    valid_iterator,
                    f"iteration {trainer.iteration}",
                    result,
                    advance_consumed=True,
                )

        save_interval = config.checkpoint.save_interval
        if exit_signal.any_rank_received(trainer.context.device):
            trainer.save()
            print_rank_0(
                f"exiting program after receiving SIGTERM at iteration {trainer.iteration}"
            )
            result.exit_reason = "signal"
            return
        if config.checkpoint.save and save_interval and trainer.iteration % save_interval == 0:
            with window.paused():
                trainer.save()
        if training.exit_duration_in_mins:
            elapsed = torch.tensor(
                [(time.time() - start_time) / 60.0], device=trainer.context.device
            )
            if dist.is_initialized():
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if elapsed.item() > training.exit_duration_in_mins:
                trainer.save()
                print_rank_0(
                    f"exiting program after {elapsed.item():.2f} minutes at iteration {trainer.iteration}"
                )
                result.exit_reason = "duration"
                return
        if training.exit_interval and trainer.iteration % training.exit_interval == 0:
            trainer.save()
            print_rank_0(f"exiting program at iteration {trainer.iteration}")
            result.exit_reason = "interval"
            return


def pretrain(
    config: Config,
    context: DistributedContext,
    model: ParallelModel,
    datasets,
    forward_step: ForwardStep,
    model_arguments: Sequence[str] = MODEL_ARGUMENTS,
    hooks: Optional[TrainingHooks] = None,
    flops_per_iteration: Optional[int] = None,
) -> TrainingResult:
    """Load (if asked), train, evaluate and save, as Megatron's `pretrain` does.

    `datasets` maps "train"/"valid"/"test" to datasets (or None). `model_arguments` name the
    saved arguments that define the model (megatron.checkpointing.model_arguments), with
    those of extensions such as the MoE layers; `hooks` do those extensions' work around the
    steps (megatron.training.hooks); `flops_per_iteration` counts a global batch's model FLOPs
    for the log line (default: a dense GPT model's).
    """
    trainer = Trainer(config, context, model, forward_step, hooks, flops_per_iteration)
    trainer.load(model_arguments)
    if trainer.metric_writers is not None:
        trainer.metric_writers.log_arguments(config.saved_arguments(), trainer.iteration)
    result = TrainingResult()
    train_iterator = build_data_iterator(
        datasets["train"], trainer.consumed_train_samples, config, context
    )
    valid_iterator = build_data_iterator(
        datasets["valid"], trainer.consumed_valid_samples, config, context
    )
    test_iterator = build_data_iterator(datasets["test"], 0, config, context)
    print_rank_0("done with setup ...")

    if trainer.iteration < total_train_iters(config):
        train(trainer, train_iterator, valid_iterator, result)
    result.iteration = trainer.iteration
    result.consumed_train_samples = trainer.consumed_train_samples
    if result.exit_reason is not None:
        _close(trainer)
        return result

    print_rank_0("after training is done ...")
    if valid_iterator is not None and config.training.eval_iters > 0:
        _validate(
            trainer,
            valid_iterator,
            "the end of training for val data",
            result,
            advance_consumed=False,
        )
    trainer.save()
    if test_iterator is not None and config.training.eval_iters > 0:
        _validate(
            trainer,
            test_iterator,
            "the end of training for test data",
            result,
            advance_consumed=False,
            split_suffix=TEST_SUFFIX,
        )
    _close(trainer)
    return result


def _close(trainer: Trainer) -> None:
    if trainer.metric_writers is not None:
        trainer.metric_writers.close()
    trainer.finish_saves()


__all__ = ["Trainer", "TrainingResult", "build_data_iterator", "pretrain", "train"]
