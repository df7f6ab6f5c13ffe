"""The training loop: train steps with gradient accumulation, evaluation, logging, saving, exits.

`pretrain` is model-agnostic: the entry point (pretrain_gpt.py) hands it a model, datasets and a
`forward_step(model, batch) -> (loss, reported)` function, where `reported` maps log names such as
"lm loss" to detached scalars averaged over micro-batches and data-parallel ranks for the log.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron import parallel_state
from megatron.checkpointing import load_checkpoint, save_checkpoint
from megatron.checkpointing.model_arguments import MODEL_ARGUMENTS
from megatron.config import Config
from megatron.data.loader import build_data_iterator
from megatron.distributed import (
    all_reduce_data_parallel_gradients,
    finalize_gradients,
    micro_batch_context,
    reduce_tied_embedding_gradients,
    wrap_data_parallel,
)
from megatron.initialize import DistributedContext, print_rank_0
from megatron.logging import (
    IterationStats,
    TensorBoardLogger,
    format_iteration_line,
    format_memory_report,
    format_times_across_ranks,
    format_validation_block,
    min_max_across_ranks,
)
from megatron.model.flops import num_floating_point_operations
from megatron.optimizer import build_lr_scheduler, build_optimizer
from megatron.optimizer.distributed_optimizer import build_distributed_optimizer
from megatron.pipeline.training_step import activation_spec, pipeline_step
from megatron.profiling import StepProfiler
from megatron.training_hooks import TrainingHooks

ForwardStep = Callable[
    [torch.nn.Module, Dict[str, torch.Tensor]], Tuple[torch.Tensor, Dict[str, torch.Tensor]]
]


@dataclass
class TrainingResult:
    """What a run did: per-iteration reported losses (for tests and tools) and how it ended."""

    iteration: int = 0
    consumed_train_samples: int = 0
    losses: List[Dict[str, float]] = field(default_factory=list)
    validation: List[Tuple[str, Dict[str, float]]] = field(default_factory=list)
    # What the training hooks logged, one entry per --log-interval window under each name
    # (megatron.training_hooks), e.g. "expert load" of an MoE model.
    records: Dict[str, List[Any]] = field(default_factory=dict)
    skipped_iterations: int = 0
    exit_reason: Optional[str] = None


def total_train_iters(config: Config) -> int:
    """--train-iters, or --train-samples in whole global batches (no batch-size ramp-up)."""
    training = config.training
    if training.train_iters is not None:
        return training.train_iters
    return training.train_samples // training.global_batch_size


def _autocast(config: Config, device: torch.device):
    if config.training.bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if config.training.fp16:
        return torch.autocast(device.type, dtype=torch.float16)
    return contextlib.nullcontext()


def _average_across_data_parallel(values: Dict[str, torch.Tensor]) -> Dict[str, float]:
    # Tensor-parallel peers of a replica hold the same values (same batch, vocab-parallel
    # loss), so the mean over replicas is the mean over the data-parallel group.
    if not values:
        return {}
    names = sorted(values)
    stacked = torch.stack([values[name].float() for name in names])
    data_parallel_size = parallel_state.get_data_parallel_world_size()
    if data_parallel_size > 1:
        dist.all_reduce(stacked, group=parallel_state.get_data_parallel_group())
        stacked /= data_parallel_size
    return dict(zip(names, stacked.tolist()))


def _to_device(batch: Dict[str, torch.Tensor], device: torch.device) -> Dict[str, torch.Tensor]:
    return {name: value.to(device, non_blocking=True) for name, value in batch.items()}


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


class Trainer:
    """Owns the model, optimizer, scheduler and iterators for one run."""

    def __init__(
        self,
        config: Config,
        run_arguments: argparse.Namespace,
        context: DistributedContext,
        model: torch.nn.Module,
        forward_step: ForwardStep,
        hooks: Optional[TrainingHooks] = None,
        flops_per_iteration: Optional[int] = None,
    ):
        self.config = config
        self.hooks = hooks or TrainingHooks()
        # Model FLOPs of one global batch for the TFLOP/s in the log line; by default those of
        # a dense GPT model of config.model.
        self.flops_per_iteration = flops_per_iteration or num_floating_point_operations(
            config.model, config.training.global_batch_size, config.data.seq_length
        )
        self.run_arguments = run_arguments
        self.context = context
        self.forward_step = forward_step
        self.unwrapped_model = model.to(context.device)
        # Under pipeline parallelism `model` is this rank's stage chunks (an nn.ModuleList).
        self.pipeline = parallel_state.get_pipeline_model_parallel_world_size() > 1
        self.activation_spec = activation_spec(config, context.device) if self.pipeline else None
        data_parallel_group = (
            parallel_state.get_data_parallel_group() if context.world_size > 1 else None
        )
        if config.parallel.use_distributed_optimizer:
            # Shards the optimizer state and does the gradient reduce-scatter itself: no DDP.
            self.optimizer = build_distributed_optimizer(
                self.unwrapped_model, config.optimizer, config.training, data_parallel_group
            )
            print_rank_0(f"> {self.optimizer.memory_report()}")
        else:
            self.optimizer = build_optimizer(
                self.unwrapped_model, config.optimizer, config.training
            )
        self.scheduler = build_lr_scheduler(self.optimizer, config.optimizer, config.training)
        data_parallel_size = parallel_state.get_data_parallel_world_size()
        wrapped_in_ddp = (
            data_parallel_size > 1
            and not config.parallel.use_distributed_optimizer
            and not self.pipeline
        )
        if wrapped_in_ddp:
            self.model = wrap_data_parallel(
                self.unwrapped_model, context.device, data_parallel_group
            )
        else:
            self.model = self.unwrapped_model
        if config.training.torch_compile and context.device.type == "cuda" and not self.pipeline:
            veto = self.hooks.compile_veto(context.device)
            if veto is None:
                # Fuses the elementwise work (norms, GELU, dropout, the loss) around the matmuls.
                self.model = torch.compile(self.model)
            else:
                # A graph broken around Triton-launched kernels can run slower than eager.
                print_rank_0(f"note: {veto}")
        self.tensorboard = (
            TensorBoardLogger(config.logging.tensorboard_dir, config.logging.tensorboard_queue_size)
            if config.logging.tensorboard_dir and context.is_first
            else None
        )
        self.hooks.setup(self.unwrapped_model, wrapped_in_ddp, context.device)
        self.iteration = 0
        self.consumed_train_samples = 0
        self.consumed_valid_samples = 0
        self.last_saved_iteration: Optional[int] = None

    # ------------------------------------------------------------------ steps
    def train_step(
        self, data_iterator: Iterator
    ) -> Tuple[Dict[str, float], bool, Optional[float], bool]:
        """One optimizer step over `num_micro_batches` micro-batches.

        Returns (reported losses, skipped, grad norm, got nan).
        """
        self.hooks.before_forwards(self.unwrapped_model)
        self.optimizer.zero_grad()
        if self.pipeline:
            means = self._pipeline_step(data_iterator)
            self.hooks.after_backwards(self.unwrapped_model)
            if not self.config.parallel.use_distributed_optimizer:
                # The distributed optimizer reduce-scatters the gradients in its step instead.
                all_reduce_data_parallel_gradients(self.unwrapped_model)
            reduce_tied_embedding_gradients(list(self.unwrapped_model))
        else:
            means = self._accumulate_micro_batches(data_iterator)
            self.hooks.after_backwards(self.unwrapped_model)
        finalize_gradients(self.unwrapped_model, self.config)
        update_successful, grad_norm, _ = self.optimizer.step()
        if update_successful:
            self.scheduler.step(increment=self.config.training.global_batch_size)
        averaged = _average_across_data_parallel(means)
        got_nan = any(
            value != value or value in (float("inf"), float("-inf")) for value in averaged.values()
        )
        return averaged, not update_successful, grad_norm, got_nan

    def _accumulate_micro_batches(self, data_iterator: Iterator) -> Dict[str, torch.Tensor]:
        """Forward and backward of every micro-batch in turn; the reported means."""
        num_micro_batches = self.config.training.num_micro_batches
        reported_sums: Dict[str, torch.Tensor] = defaultdict(
            lambda: torch.zeros((), device=self.context.device)
        )
        for index in range(num_micro_batches):
            batch = _to_device(next(data_iterator), self.context.device)
            with micro_batch_context(self.model, index, num_micro_batches):
                with _autocast(self.config, self.context.device):
                    loss, reported = self.forward_step(self.model, batch)
                self.optimizer.scale_loss(loss / num_micro_batches).backward()
            for name, value in reported.items():
                reported_sums[name] += value.detach().float()
        return {name: value / num_micro_batches for name, value in reported_sums.items()}

    def _pipeline_step(
        self, data_iterator: Iterator, forward_only: bool = False
    ) -> Dict[str, torch.Tensor]:
        """One global batch through this rank's pipeline stages (megatron.pipeline)."""
        return pipeline_step(
            self.model,
            self._stage_forward_step,
            data_iterator,
            self.config,
            self.activation_spec,
            self.optimizer.scale_loss,
            forward_only=forward_only,
        )

    def _stage_forward_step(
        self, model: torch.nn.Module, batch: Dict[str, torch.Tensor]
    ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """`forward_step` on one pipeline chunk, as the schedules call it."""
        with _autocast(self.config, self.context.device):
            return self.forward_step(model, _to_device(batch, self.context.device))

    @torch.no_grad()
    def evaluate(self, data_iterator: Iterator, eval_iters: int) -> Dict[str, float]:
        """Average reported losses over `eval_iters` global batches, without dropout."""
        self.hooks.before_forwards(self.unwrapped_model)
        self.model.eval()
        sums: Dict[str, torch.Tensor] = defaultdict(
            lambda: torch.zeros((), device=self.context.device)
        )
        count = 0
        for _ in range(eval_iters):
            if self.pipeline:
                means = self._pipeline_step(data_iterator, forward_only=True)
                for name, value in means.items():
                    sums[name] += value
                count += 1
                continue
            for _ in range(self.config.training.num_micro_batches):
                batch = _to_device(next(data_iterator), self.context.device)
                with _autocast(self.config, self.context.device):
                    _, reported = self.forward_step(self.model, batch)
                for name, value in reported.items():
                    sums[name] += value.float()
                count += 1
        self.model.train()
        means = {name: value / max(count, 1) for name, value in sums.items()}
        return _average_across_data_parallel(means)

    # ------------------------------------------------------------- checkpoints
    def load(self, model_arguments: Sequence[str] = MODEL_ARGUMENTS) -> None:
        """Resume from --load (Megatron's load-checkpoint time line after it); `model_arguments`
        are the saved arguments compared with this run's (megatron.checkpointing.load)."""
        checkpoint = self.config.checkpoint
        start = self._timer_start()
        state = load_checkpoint(
            checkpoint,
            self.unwrapped_model,
            self.optimizer,
            self.scheduler,
            print_fn=print_rank_0,
            args=self.run_arguments,
            model_arguments=model_arguments,
        )
        if checkpoint.load:
            self._log_time("load-checkpoint", start)
        self.iteration = state.iteration
        self.consumed_train_samples = state.consumed_train_samples
        self.consumed_valid_samples = state.consumed_valid_samples
        if (
            state.loaded_from is not None
            and checkpoint.save
            and state.iteration > 0
            and os.path.realpath(checkpoint.load) == os.path.realpath(checkpoint.save)
        ):
            # That state is on disk already: a relaunched finished run does not write it again.
            self.last_saved_iteration = state.iteration

    def save(self) -> None:
        """Save this iteration under --save unless it is saved already, then log the time."""
        if not self.config.checkpoint.save or self.last_saved_iteration == self.iteration:
            return
        self.run_arguments.consumed_train_samples = self.consumed_train_samples
        self.run_arguments.consumed_valid_samples = self.consumed_valid_samples
        start = self._timer_start()
        save_checkpoint(
            self.config.checkpoint,
            self.iteration,
            self.unwrapped_model,
            self.optimizer,
            self.scheduler,
            self.run_arguments,
            consumed_train_samples=self.consumed_train_samples,
            consumed_valid_samples=self.consumed_valid_samples,
            print_fn=print_rank_0,
        )
        self._log_time("save-checkpoint", start)
        self.last_saved_iteration = self.iteration

    def _timer_start(self) -> float:
        # As Megatron's timers: every rank starts and stops together, so the times compare.
        if dist.is_initialized():
            dist.barrier()
        return time.perf_counter()

    def _log_time(self, name: str, start: float) -> None:
        if dist.is_initialized():
            dist.barrier()
        seconds = time.perf_counter() - start
        times = min_max_across_ranks(seconds, self.context.device)
        print_rank_0(format_times_across_ranks({name: times}))


def _throughput(trainer: Trainer, seconds_per_iteration: float) -> Tuple[float, float, float]:
    config, world_size = trainer.config, trainer.context.world_size
    tokens = config.training.global_batch_size * config.data.seq_length
    tokens_per_second = tokens / seconds_per_iteration
    tflops_per_gpu = trainer.flops_per_iteration / seconds_per_iteration / world_size / 1e12
    return tokens_per_second, tokens_per_second / world_size, tflops_per_gpu


def _validate(
    trainer: Trainer, iterator, prefix: str, result: TrainingResult, advance_consumed: bool
) -> None:
    config = trainer.config
    losses = trainer.evaluate(iterator, config.training.eval_iters)
    if advance_consumed:
        trainer.consumed_valid_samples += (
            config.training.eval_iters * config.training.global_batch_size
        )
    print_rank_0(format_validation_block(prefix, losses))
    result.validation.append((prefix, losses))
    if trainer.tensorboard is not None:
        trainer.tensorboard.log_validation(
            losses, trainer.iteration, trainer.consumed_train_samples
        )


def train(trainer: Trainer, train_iterator, valid_iterator, result: TrainingResult) -> None:
    """Run iterations until --train-iters or an exit condition; log, evaluate and save on schedule."""
    profiler = StepProfiler(trainer.config.logging, trainer.context.rank, trainer.context.device)
    try:
        _train_loop(trainer, train_iterator, valid_iterator, result, profiler)
    finally:
        profiler.stop()  # a run that ends before --profile-step-end still writes its trace


def _train_loop(
    trainer: Trainer, train_iterator, valid_iterator, result: TrainingResult, profiler: StepProfiler
) -> None:
    config = trainer.config
    training, logging_config = config.training, config.logging
    exit_signal = _ExitSignal(training.exit_signal_handler)
    start_time = time.time()
    window_start = time.time()
    window_iterations = 0
    window_sums: Dict[str, float] = defaultdict(float)
    window_advanced = 0
    window_skipped = 0
    window_nan = 0
    last_grad_norm: Optional[float] = None
    report_memory = True  # once, after the first logged iteration, as Megatron does
    trainer.model.train()
    print_rank_0("training ...")
    train_iters = total_train_iters(config)
    while trainer.iteration < train_iters:
        profiler.before_step(trainer.iteration)
        losses, skipped, grad_norm, got_nan = trainer.train_step(train_iterator)
        trainer.iteration += 1
        profiler.after_step(trainer.iteration)
        trainer.consumed_train_samples += training.global_batch_size
        window_iterations += 1
        result.losses.append(losses)
        if skipped:
            window_skipped += 1
            result.skipped_iterations += 1
            window_nan += int(got_nan)
        else:
            window_advanced += 1
            for name, value in losses.items():
                window_sums[name] += value
            last_grad_norm = grad_norm

        if trainer.iteration % logging_config.log_interval == 0:
            if trainer.context.device.type == "cuda":
                torch.cuda.synchronize()
            seconds_per_iteration = (time.time() - window_start) / window_iterations
            tokens_per_second, tokens_per_gpu, tflops = _throughput(trainer, seconds_per_iteration)
            stats = IterationStats(
                iteration=trainer.iteration,
                train_iters=train_iters,
                consumed_samples=trainer.consumed_train_samples,
                elapsed_ms_per_iteration=seconds_per_iteration * 1000.0,
                learning_rate=trainer.optimizer.param_groups[0]["lr"],
                global_batch_size=training.global_batch_size,
                losses={
                    name: value / max(window_advanced, 1) for name, value in window_sums.items()
                },
                loss_scale=trainer.optimizer.loss_scale,
                grad_norm=last_grad_norm,
                skipped_iterations=window_skipped,
                nan_iterations=window_nan,
                tokens_per_second=tokens_per_second,
                tokens_per_second_per_gpu=tokens_per_gpu,
                tflops_per_gpu=tflops,
            )
            print_rank_0(format_iteration_line(stats))
            if report_memory and trainer.context.device.type == "cuda":
                print_rank_0(
                    format_memory_report(
                        trainer.context.rank, trainer.iteration, trainer.context.device
                    )
                )
                report_memory = False
            if trainer.tensorboard is not None:
                trainer.tensorboard.log_training(stats)
            records = trainer.hooks.log(
                trainer.unwrapped_model, trainer.iteration, print_rank_0, trainer.tensorboard
            )
            for name, record in records.items():
                result.records.setdefault(name, []).append(record)
            window_start, window_iterations = time.time(), 0
            window_sums, window_advanced, window_skipped, window_nan = defaultdict(float), 0, 0, 0

        if (
            valid_iterator is not None
            and training.eval_interval
            and trainer.iteration % training.eval_interval == 0
        ):
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
    run_arguments: argparse.Namespace,
    context: DistributedContext,
    model: torch.nn.Module,
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
    steps (megatron.training_hooks); `flops_per_iteration` counts a global batch's model FLOPs
    for the log line (default: a dense GPT model's).
    """
    trainer = Trainer(
        config, run_arguments, context, model, forward_step, hooks, flops_per_iteration
    )
    trainer.load(model_arguments)
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
        )
    _close(trainer)
    return result


def _close(trainer: Trainer) -> None:
    if trainer.tensorboard is not None:
        trainer.tensorboard.close()


__all__ = ["Trainer", "TrainingResult", "build_data_iterator", "pretrain", "train"]
