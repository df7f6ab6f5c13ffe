"""`Trainer`: one run's model, optimizer and scheduler, and what it does with them: a training
step (gradient accumulation or a pipeline schedule), evaluation, checkpoint save and load.

The loop around it (schedule, logging, exits) is megatron.training.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections import defaultdict
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.checkpointing import load_checkpoint, save_checkpoint
from megatron.checkpointing.async_save import AsyncCheckpointWriter
from megatron.checkpointing.finite import agreed_first_non_finite
from megatron.checkpointing.layout import iteration_directory_name
from megatron.checkpointing.model_arguments import MODEL_ARGUMENTS
from megatron.checkpointing.rng import capture_rng_state, restore_rng_state
from megatron.config import Config
from megatron.errors import TrainingDiverged
from megatron.initialize import DistributedContext, print_rank_0
from megatron.model.flops import num_floating_point_operations
from megatron.optimizer import build_lr_scheduler
from megatron.optimizer.precision import PrecisionAwareAdamW
from megatron.parallel import parallel_state
from megatron.parallelize.data_parallel import install_parameter_waits
from megatron.parallelize.steps import ParallelModel
from megatron.pipeline.training_step import activation_spec, pipeline_step
from megatron.training.hooks import TrainingHooks
from megatron.training.logging import format_times_across_ranks, min_max_across_ranks
from megatron.training.metric_writers import open_metric_writers

ForwardStep = Callable[
    [torch.nn.Module, Dict[str, torch.Tensor]], Tuple[torch.Tensor, Dict[str, torch.Tensor]]
]


def _autocast(config: Config, device: torch.device):
    numerics = config.numerics
    if numerics.autocast:
        return torch.autocast(device.type, dtype=numerics.compute_dtype)
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


class Trainer:
    """Owns the model, optimizer, scheduler and iterators for one run."""

    def __init__(
        self,
        config: Config,
        context: DistributedContext,
        model: ParallelModel,
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
        self.context = context
        self.forward_step = forward_step
        self.unwrapped_model = model.unwrapped
        self.model = model.module
        self.pipeline = model.pipeline
        self.activation_spec = activation_spec(config, context.device) if self.pipeline else None
        self.data_parallel = model.data_parallel
        self.optimizer = self.data_parallel.build_optimizer(self.unwrapped_model)
        if isinstance(self.optimizer.optimizer, PrecisionAwareAdamW):
            description = self.optimizer.optimizer.describe(config.numerics.main_grads_dtype)
            print_rank_0(f"> {description}")
        self.scheduler = build_lr_scheduler(self.optimizer, config.optimizer, config.training)
        self.metric_writers = open_metric_writers(config, context.is_first)
        self.hooks.setup(self.unwrapped_model, self.data_parallel, context.device)
        # When the parameters of each layer arrive only just before its forward, every module
        # waits for its own there; otherwise all are waited for before the forwards begin.
        if self.data_parallel.gathers_by_layer:
            install_parameter_waits(
                self.unwrapped_model,
                self.data_parallel.wait_for_parameters,
                self.hooks.before_layer_forward,
            )
            self.hooks.weights_arrive_by_layer()
        self.iteration = 0
        self.consumed_train_samples = 0
        self.consumed_valid_samples = 0
        self.last_saved_iteration: Optional[int] = None
        self.loaded_from: Optional[str] = None
        self.async_writer = AsyncCheckpointWriter() if config.checkpoint.async_save else None

    # ------------------------------------------------------------------ steps
    def train_step(
        self, data_iterator: Iterator
    ) -> Tuple[Dict[str, float], bool, Optional[float], bool]:
        """One optimizer step over `num_micro_batches` micro-batches.

        Returns (reported losses, skipped, grad norm, got nan).
        """
        if not self.hooks.before_step(self.unwrapped_model):
            means = self._forwards_and_backwards(data_iterator)
        else:
            means = self._forwards_and_backwards_until_valid(data_iterator)
        self.data_parallel.after_backwards(self.unwrapped_model)
        # Before the step: its parameter all-gather (in flight with --overlap-param-gather)
        # would otherwise run ahead of this all-reduce on the same group, and reading the
        # losses would hold the next forward until the whole gather had arrived.
        averaged = _average_across_data_parallel(means)
        update_successful, grad_norm, _ = self.optimizer.step()
        # A skipped fp16 step's gradients overflowed by design: only its loss counts.
        got_nan = not all(math.isfinite(value) for value in averaged.values()) or (
            update_successful and grad_norm is not None and not math.isfinite(grad_norm)
        )
        if self.config.training.check_for_nan_in_loss_and_grad:
            self._stop_if_diverged(got_nan, averaged, grad_norm if update_successful else None)
        if update_successful:
            self.scheduler.step(increment=self.config.training.global_batch_size)
            if self.async_writer is not None and not self.async_writer.prepared:
                # The optimizer has its state now; the buffers take the tensors as saved.
                saves_optimizer = not self.config.checkpoint.no_save_optim
                with self.data_parallel.full_precision_parameters():
                    self.async_writer.prepare(
                        self.unwrapped_model, self.optimizer if saves_optimizer else None
                    )
        return averaged, not update_successful, grad_norm, got_nan

    def _stop_if_diverged(
        self, got_nan: bool, losses: Dict[str, float], grad_norm: Optional[float]
    ) -> None:
        """Raise TrainingDiverged on every rank when any rank saw a non-finite loss or gradient
        norm (pipeline stages other than the last have no loss: they learn it here)."""
        if self.pipeline:
            flag = torch.tensor([float(got_nan)], device=self.context.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            got_nan = bool(flag.item())
        if not got_nan:
            return
        values = [
            f"{name} is {value}" for name, value in losses.items() if not math.isfinite(value)
        ]
        if grad_norm is not None and not math.isfinite(grad_norm):
            values.append(f"the gradient norm is {grad_norm}")
        what = ", ".join(values) or "the loss on the last pipeline stage is not finite"
        raise TrainingDiverged(
            f"iteration {self.iteration + 1}: {what}; the run stops before saving anything of "
            f"it ({self.last_good_checkpoint()}); lower the learning rate or check the data, "
            "or pass --no-check-for-nan-in-loss-and-grad to train on"
        )

    def last_good_checkpoint(self) -> str:
        """Where this run's state was last saved or loaded from, for messages."""
        save = self.config.checkpoint.save
        if save and self.last_saved_iteration is not None:
            name = iteration_directory_name(self.last_saved_iteration)
            return f"the last good checkpoint is {os.path.join(save, name)}"
        if self.loaded_from is not None:
            return f"the last good checkpoint is the one loaded, {self.loaded_from}"
        return "this run has saved no checkpoint yet"

    def _forwards_and_backwards(self, data_iterator: Iterator) -> Dict[str, torch.Tensor]:
        """Every micro-batch's forward and backward from fresh gradients, then the hooks' work
        after the backwards; the reported means."""
        self._wait_for_parameters()
        self.hooks.before_forwards(self.unwrapped_model)
        self.optimizer.zero_grad()
        if self.pipeline:
            means = self._pipeline_step(data_iterator)
        else:
            means = self._accumulate_micro_batches(data_iterator)
        self.hooks.after_backwards(self.unwrapped_model)
        return means

    def _forwards_and_backwards_until_valid(
        self, data_iterator: Iterator
    ) -> Dict[str, torch.Tensor]:
        """`_forwards_and_backwards`, run again from the step's random state and micro-batches
        while the hooks ask for it (`TrainingHooks.rerun_step`)."""
        random_state = capture_rng_state()
        micro_batches = _Recorded(data_iterator)
        source: Iterator = micro_batches
        runs = 1
        while True:
            means = self._forwards_and_backwards(source)
            note = self.hooks.rerun_step(self.unwrapped_model)
            if note is None:
                return means
            if runs > MAX_STEP_RERUNS:
                raise RuntimeError(
                    f"iteration {self.iteration + 1} ran {runs} times and still asks for "
                    f"another run: {note}"
                )
            print_rank_0(f"note: iteration {self.iteration + 1} runs again: {note}")
            # The same micro-batches, dropout masks and expert choices as the first run.
            restore_rng_state([random_state], 0, "the step's start")
            source = micro_batches.replay()
            runs += 1

    def _accumulate_micro_batches(self, data_iterator: Iterator) -> Dict[str, torch.Tensor]:
        """Forward and backward of every micro-batch in turn; the reported means."""
        num_micro_batches = self.config.training.num_micro_batches
        reported_sums: Dict[str, torch.Tensor] = defaultdict(
            lambda: torch.zeros((), device=self.context.device)
        )
        for index in range(num_micro_batches):
            batch = _to_device(next(data_iterator), self.context.device)
            if index == num_micro_batches - 1:
                self.data_parallel.last_backward_starts()
            with self.data_parallel.micro_batch_context(self.model, index, num_micro_batches):
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
        self.mark_progress(f"evaluation after iteration {self.iteration}")
        self._wait_for_parameters()
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
        # Checkpoints hold fp32 weights, whatever dtype the model computes with.
        with self.data_parallel.full_precision_parameters():
            state = load_checkpoint(
                checkpoint,
                self.unwrapped_model,
                self.optimizer,
                self.scheduler,
                print_fn=print_rank_0,
                args=self.config.saved_arguments(),
                model_arguments=model_arguments,
            )
        if checkpoint.load:
            self._log_time("load-checkpoint", start)
        self.iteration = state.iteration
        self.loaded_from = state.loaded_from
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
        self.mark_progress(f"the save of iteration {self.iteration}")
        self.data_parallel.finish_parameter_gather()
        # Never a checkpoint with non-finite weights (with --no-check-for-nan-in-loss-and-grad
        # a diverged run gets this far): it would be the one the next run resumes from.
        bad = agreed_first_non_finite(self.unwrapped_model.named_parameters())
        if bad is not None:
            raise TrainingDiverged(
                f"iteration {self.iteration}: the weight {bad} is not finite, so it is not saved "
                f"({self.last_good_checkpoint()})"
            )
        start = self._timer_start()
        with self.data_parallel.full_precision_parameters():
            save_checkpoint(
                self.config.checkpoint,
                self.iteration,
                self.unwrapped_model,
                self.optimizer,
                self.scheduler,
                self.config.saved_arguments(),
                consumed_train_samples=self.consumed_train_samples,
                consumed_valid_samples=self.consumed_valid_samples,
                print_fn=print_rank_0,
                async_writer=self.async_writer,
            )
        # With --async-save this is the time training was blocked: the write goes on.
        self._log_time("save-checkpoint", start)
        self.last_saved_iteration = self.iteration

    def _wait_for_parameters(self) -> None:
        """Before the forwards: every parameter's all-gather done, unless each module waits
        for its own (`install_parameter_waits`)."""
        if not self.data_parallel.gathers_by_layer:
            self.data_parallel.finish_parameter_gather()

    def finish_saves(self) -> None:
        """Wait for a checkpoint still being written in the background (--async-save); raises
        CheckpointError when its write failed."""
        if self.async_writer is not None:
            self.async_writer.wait(print_rank_0)

    def mark_progress(self, where: str) -> None:
        """Record where this rank is (megatron.parallel.progress_board), in multi-process runs."""
        if self.context.progress is not None:
            self.context.progress.mark(where)

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


# A hook asks for another run only when the first one could not stand (moe.exchange.fixed_blocks's
# blocks overflowed), and fixes the cause before asking: more than this is a bug.
MAX_STEP_RERUNS = 3


class _Recorded:
    """An iterator's items as they are taken, for `replay`."""

    def __init__(self, iterator: Iterator) -> None:
        self._iterator = iterator
        self._taken: list = []

    def __iter__(self) -> _Recorded:
        return self

    def __next__(self):
        item = next(self._iterator)
        self._taken.append(item)
        return item

    def replay(self) -> Iterator:
        """The items taken so far, again."""
        return iter(list(self._taken))
