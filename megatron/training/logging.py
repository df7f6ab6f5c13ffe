"""Megatron's log lines (users parse them), the dashboard scalars and TensorBoard's writer."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist


@dataclass
class IterationStats:
    """What one `--log-interval` window of training produced, averaged where Megatron averages."""

    iteration: int
    train_iters: int
    consumed_samples: int
    elapsed_ms_per_iteration: float
    learning_rate: float
    global_batch_size: int
    losses: Dict[str, float]
    loss_scale: float
    grad_norm: Optional[float]
    skipped_iterations: int
    nan_iterations: int
    tokens_per_second: float
    tokens_per_second_per_gpu: float
    tflops_per_gpu: float
    num_zeros_in_grad: Optional[int] = None
    params_norm: Optional[float] = None
    # Fields model extensions add after the throughput (megatron.training.hooks), by name.
    extra: Dict[str, float] = field(default_factory=dict)


def format_iteration_line(stats: IterationStats) -> str:
    """Megatron's per-iteration line, field for field, then the throughput fields."""
    line = f" iteration {stats.iteration:8d}/{stats.train_iters:8d} |"
    line += f" consumed samples: {stats.consumed_samples:12d} |"
    line += f" elapsed time per iteration (ms): {stats.elapsed_ms_per_iteration:.1f} |"
    line += f" learning rate: {stats.learning_rate:.3E} |"
    line += f" global batch size: {stats.global_batch_size:5d} |"
    for name, value in stats.losses.items():
        line += f" {name}: {value:.6E} |"
    line += f" loss scale: {stats.loss_scale:.1f} |"
    if stats.grad_norm is not None:
        line += f" grad norm: {stats.grad_norm:.3f} |"
    if stats.num_zeros_in_grad is not None:
        line += f" num zeros: {stats.num_zeros_in_grad:.1f} |"
    if stats.params_norm is not None:
        line += f" params norm: {stats.params_norm:.3f} |"
    line += f" number of skipped iterations: {stats.skipped_iterations:3d} |"
    line += f" number of nan iterations: {stats.nan_iterations:3d} |"
    line += f" throughput per GPU (TFLOP/s/GPU): {stats.tflops_per_gpu:.1f} |"
    line += f" tokens per second: {stats.tokens_per_second:.0f} |"
    line += f" tokens per second per GPU: {stats.tokens_per_second_per_gpu:.0f} |"
    for name, value in stats.extra.items():
        line += f" {name}: {value:.3f} |"
    return line


def format_memory_report(rank: int, iteration: int, device: torch.device) -> str:
    """Megatron's one-time memory line, printed after the first logged iteration:
    `[Rank R] (after N iterations) memory (MB) | allocated: ... | max allocated: ... | ...`."""
    mega_bytes = 1024.0 * 1024.0
    line = f"[Rank {rank}] (after {iteration} iterations) memory (MB)"
    line += f" | allocated: {torch.cuda.memory_allocated(device) / mega_bytes}"
    line += f" | max allocated: {torch.cuda.max_memory_allocated(device) / mega_bytes}"
    line += f" | reserved: {torch.cuda.memory_reserved(device) / mega_bytes}"
    line += f" | max reserved: {torch.cuda.max_memory_reserved(device) / mega_bytes}"
    return line


def format_compile_report(iteration: int) -> Optional[str]:
    """What torch.compile captured in this process, printed once after the first logged
    iteration: `> torch.compile (after N iterations): G graphs, B graph breaks`; None where
    nothing was compiled. Each graph break returns to Python between graphs that Inductor
    optimizes apart: the first thing to look at when a compiled model runs slower than it
    should."""
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    if not graphs:
        return None
    breaks = sum(counters["graph_break"].values())
    return f"> torch.compile (after {iteration} iterations): {graphs} graphs, {breaks} graph breaks"


def format_times_across_ranks(times_ms: Dict[str, Tuple[float, float]]) -> str:
    """Megatron's timer block: `(min, max) time across ranks (ms):`, then one line per timer
    (`    save-checkpoint ....: (24895.07, 24895.13)`), the name dot-padded to 48 characters."""
    lines = ["(min, max) time across ranks (ms):"]
    for name, (fastest, slowest) in times_ms.items():
        lines.append(f"    {(name + ' ').ljust(48, '.')}: ({fastest:.2f}, {slowest:.2f})")
    return "\n".join(lines)


def min_max_across_ranks(seconds: float, device: torch.device) -> Tuple[float, float]:
    """The smallest and largest of every rank's `seconds`, in milliseconds (a collective)."""
    extremes = torch.tensor([-seconds * 1000.0, seconds * 1000.0], device=device)
    if dist.is_initialized():
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    return -extremes[0].item(), extremes[1].item()


def format_validation_block(prefix: str, losses: Dict[str, float]) -> str:
    """Megatron's validation block: `<name> value` and `<name> PPL` between dashed rules."""
    text = f" validation loss at {prefix} | "
    for name, value in losses.items():
        text += f"{name} value: {value:.6E} | "
        if math.isfinite(value):  # no perplexity of a NaN (exp(min(20, nan)) is exp(20))
            text += f"{name} PPL: {math.exp(min(20.0, value)):.6E} | "
    rule = "-" * (len(text) + 1)
    return f"{rule}\n{text}\n{rule}"


# Megatron's TensorBoard names that gpt_pretraining.run_events reads back.
TOKENS_PER_SECOND_PER_GPU = "throughput/tokens-per-second-per-gpu"
# Seconds per iteration of the log window (Megatron's name, which it writes only with
# --log-timers-to-tensorboard): always written, since summing it is how a run's training time is
# read back without the time between the jobs of a resumed run (gpt_pretraining.time_to_quality).
ITERATION_TIME = "iteration-time"
VALIDATION_SUFFIX = " validation"
# The test split's loss, evaluated once after training. Megatron logs it under the validation
# names, at the last iteration, where it would read as one more point of the validation curve;
# a name of its own keeps the curve the validation split's.
TEST_SUFFIX = " test"
SAMPLES_SUFFIX = " vs samples"  # the same scalar against consumed samples instead of iterations


def argument_text_tag(name: str) -> str:
    """The tag under which `log_arguments` writes the argument `name` (torch's add_text
    appends `/text_summary`)."""
    return f"{name}/text_summary"


def training_scalars(stats: IterationStats) -> Dict[str, float]:
    """Megatron's dashboard scalars of one log window, by name: what TensorBoard and W&B get."""
    scalars = {
        "learning-rate": stats.learning_rate,
        "batch-size": stats.global_batch_size,
        "loss-scale": stats.loss_scale,
        ITERATION_TIME: stats.elapsed_ms_per_iteration / 1000.0,
        TOKENS_PER_SECOND_PER_GPU: stats.tokens_per_second_per_gpu,
        "throughput/tflops-per-gpu": stats.tflops_per_gpu,
        **stats.losses,
        **stats.extra,
    }
    if stats.grad_norm is not None:
        scalars["grad-norm"] = stats.grad_norm
    return scalars


def validation_scalars(
    losses: Dict[str, float], split_suffix: str = VALIDATION_SUFFIX
) -> Dict[str, float]:
    """Megatron's dashboard scalars of one evaluation: `<name> validation` and its perplexity
    `<name> validation ppl`; with `split_suffix` TEST_SUFFIX, `<name> test` and
    `<name> test ppl` for the test split's."""
    scalars = {}
    for name, value in losses.items():
        scalars[f"{name}{split_suffix}"] = value
        scalars[f"{name}{split_suffix} ppl"] = math.exp(min(20.0, value))
    return scalars


class TensorBoardLogger:
    """Megatron's scalar names, against iterations and (`... vs samples`) consumed samples."""

    def __init__(self, log_dir: str, queue_size: int = 1000):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=log_dir, max_queue=queue_size)

    def log_training(self, stats: IterationStats) -> None:
        self._write_with_samples(training_scalars(stats), stats.iteration, stats.consumed_samples)

    def log_validation(
        self,
        losses: Dict[str, float],
        iteration: int,
        consumed_samples: int,
        split_suffix: str = VALIDATION_SUFFIX,
    ) -> None:
        self._write_with_samples(
            validation_scalars(losses, split_suffix), iteration, consumed_samples
        )

    def _write_with_samples(
        self, scalars: Dict[str, float], iteration: int, consumed_samples: int
    ) -> None:
        for name, value in scalars.items():
            self._writer.add_scalar(name, value, iteration)
            self._writer.add_scalar(f"{name}{SAMPLES_SUFFIX}", value, consumed_samples)

    def log_arguments(self, arguments: argparse.Namespace, iteration: int) -> None:
        """Every argument of the run as a text summary, as Megatron's
        write_args_to_tensorboard does: what the event files alone need to be read back (the
        sequence length turns consumed samples into tokens)."""
        for name, value in sorted(vars(arguments).items()):
            self._writer.add_text(name, str(value), iteration)

    def log_histogram(self, name: str, values: torch.Tensor, iteration: int) -> None:
        self._writer.add_histogram(name, values, iteration)

    def log_scalars(self, scalars: Dict[str, float], iteration: int) -> None:
        for name, value in scalars.items():
            self._writer.add_scalar(name, value, iteration)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()
