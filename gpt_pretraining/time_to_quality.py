"""Time to quality: the tokens and the training time each of several runs takes to reach a
validation loss, from their TensorBoard event files; the library of tools/time_to_quality.py
(its flags, `parse_arguments`; its entry, `main`).

For each run (read by gpt_pretraining.run_events) one row of a Markdown table: its final
validation loss (the last point of `lm loss validation`), the test split's loss (`lm loss test`,
evaluated once after training and kept apart from the validation curve), the tokens it trained
on, its training time and tokens per second over that time, and the tokens and the training time
at which its validation curve first reaches the target loss, with the speed-up over the first
run in each (the first run's tokens or time to the target over this run's). The target is
--target-loss, by default the first run's final validation loss. Runs given the same --labels
name are seeds of one recipe: a second table gives each recipe's mean and spread
(gpt_pretraining.seed_spread). Between the two evaluations that bracket the target, tokens and
time are interpolated linearly in the loss; a curve whose first evaluation is already at or
below the target reaches it there; one that never reaches it is "not reached". Evaluations
whose loss is not finite (a diverged run) are left out.

Training time is the sum, over the logged --log-interval windows, of the window's seconds per
iteration (`iteration-time`) times its iterations (those since the previous logged iteration).
It leaves out what is not a training step: start-up and checkpoint loading, evaluations and
checkpoint saves (the trainer's window pauses around them, as Megatron's interval timer does),
and the time between the jobs of a run made in pieces (stopped by --exit-duration-in-mins and
resumed in a later job), whose event files' wall-clock times are never read. The first window
each job logs also holds that job's warm-up (torch.compile, kernel autotuning, the allocator
growing): it counts at the median seconds per iteration of the job's other windows, so that a
run made in three jobs is not charged three warm-ups and compares with a run made in one (a job
that logged one window counts it as logged). A job that resumes from a checkpoint logs again
the iterations its predecessor ran past that checkpoint: each counts once, at the later job's
time (run_events keeps the later job's points). An evaluation's time is the training time at its
iteration: interpolated between the logged iterations around it, past the last one at the last
window's rate.

Tokens are consumed samples times the sequence length, as run_events reads them (--seq-length
for runs that do not record theirs).

The picture (--output, default ./time_to_quality.png): validation loss against tokens (left)
and training time (right), one colour per run, the target a dashed line and each run's crossing
a cross on it. The loss axis shows where the curves differ rather than the drop from the
untrained loss, which would flatten them: from the lowest validation loss of any run (or the
target, if lower) to the highest evaluation of any run from a tenth of the first run's tokens
on (a run with no evaluation that late: its last), widened by 5% either way. The curves' earlier
points are drawn past the top of the axis.
matplotlib is an optional extra (`pip install -e '.[plot]'`); --no-plot prints the table alone.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

import numpy as np

from gpt_pretraining.plot_runs import time_unit
from gpt_pretraining.run_events import (
    ITERATION_TIME,
    LM_LOSS_TEST,
    LM_LOSS_VALIDATION,
    RunEvents,
    RunEventsError,
    read_run,
)
from megatron.errors import UserError, traceback_asked

if TYPE_CHECKING:  # matplotlib is an optional extra, imported where the picture is drawn
    from matplotlib.figure import Figure

# In the current directory, not a run's: a comparison of several runs belongs to none of them.
DEFAULT_OUTPUT = "time_to_quality.png"
# Where the loss axis's top is read (module docstring): past the first run's initial drop.
LOSS_AXIS_FROM_TOKEN_FRACTION = 0.1
LOSS_AXIS_MARGIN = 0.05  # of the loss axis's range, below and above
FIGURE_SIZE_INCHES = (12.0, 4.5)  # width, height
DPI = 100
NOT_REACHED = "not reached"
MATPLOTLIB_MISSING = (
    "tools/time_to_quality.py draws with matplotlib, an optional extra: "
    "pip install -e '.[plot]' (or pass --no-plot for the table alone)"
)
TABLE_COLUMNS = (
    "run", "jobs", "final validation loss", "test loss", "tokens", "training time", "tokens/s",
    "tokens to target", "time to target", "speed-up (tokens)", "speed-up (time)",
)  # fmt: skip


def parse_arguments(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """tools/time_to_quality.py's flags."""
    parser = argparse.ArgumentParser(
        prog="tools/time_to_quality.py",
        description="Tokens and training time for runs to reach a validation loss, from "
        "their TensorBoard files: a Markdown table and a PNG.",
    )
    parser.add_argument(
        "run_directories",
        nargs="+",
        metavar="RUN_DIR",
        help="a run's output directory (holding tensorboard/) or its --tensorboard-dir; the "
        "first is the reference of the speed-ups",
    )
    parser.add_argument(
        "--target-loss",
        type=float,
        default=None,
        help="the validation loss to reach (default: the first run's final validation loss)",
    )
    parser.add_argument(
        "--labels",
        nargs="+",
        default=None,
        help="one name per RUN_DIR (default: their names); runs of one name are one recipe's "
        "seeds, summed up in a second table",
    )
    parser.add_argument(
        "--output", default=DEFAULT_OUTPUT, help=f"the PNG to write (default ./{DEFAULT_OUTPUT})"
    )
    parser.add_argument("--no-plot", action="store_true", help="print the table, draw nothing")
    parser.add_argument(
        "--seq-length",
        type=int,
        default=None,
        help="tokens per sample, for runs whose event files do not record it",
    )
    return parser.parse_args(argv)


@dataclass(frozen=True)
class TrainingClock:
    """A run's training time (module docstring) after each iteration that logged its time."""

    iterations: np.ndarray  # int64 [windows + 1], iteration 0 first
    seconds: np.ndarray  # float64 [windows + 1], cumulative training seconds, 0 first
    jobs: int  # how many jobs logged the windows kept

    def seconds_at(self, iterations: np.ndarray) -> np.ndarray:
        """Training seconds after each of `iterations`: interpolated between the logged
        iterations, past the last one at the last window's seconds per iteration."""
        at = iterations.astype(np.float64)
        seconds = np.interp(at, self.iterations, self.seconds)
        last_rate = (self.seconds[-1] - self.seconds[-2]) / (
            self.iterations[-1] - self.iterations[-2]
        )
        beyond = at > self.iterations[-1]
        seconds[beyond] = self.seconds[-1] + last_rate * (at[beyond] - self.iterations[-1])
        return seconds


def training_clock(run: RunEvents) -> TrainingClock:
    """The run's training clock, from its logged seconds per iteration (module docstring)."""
    if ITERATION_TIME not in run.series:
        raise RunEventsError(
            f"{run.directory}: its event files hold no '{ITERATION_TIME}' scalar, which training "
            "time is summed from (runs logged before the trainer wrote it); rerun the run"
        )
    logged = run.series[ITERATION_TIME]
    seconds_per_iteration = logged.values.copy()
    for job in np.unique(logged.jobs):
        windows = np.flatnonzero(logged.jobs == job)
        if len(windows) > 1:  # the job's first window holds its warm-up
            seconds_per_iteration[windows[0]] = np.median(logged.values[windows[1:]])
    iterations = np.concatenate([[0], logged.iterations])
    window_iterations = np.diff(iterations)
    seconds = np.concatenate([[0.0], np.cumsum(seconds_per_iteration * window_iterations)])
    return TrainingClock(iterations, seconds, jobs=len(np.unique(logged.jobs)))


@dataclass(frozen=True)
class ValidationCurve:
    """A run's validation loss at each evaluation, with the tokens and the training time
    before it."""

    iterations: np.ndarray  # int64 [evaluations]
    losses: np.ndarray  # float64 [evaluations]
    tokens: np.ndarray  # float64 [evaluations]
    seconds: np.ndarray  # float64 [evaluations], training time


@dataclass(frozen=True)
class Crossing:
    """Where a validation curve first reaches the target loss."""

    tokens: float
    seconds: float


def first_crossing(curve: ValidationCurve, target: float) -> Optional[Crossing]:
    """The tokens and training time at which `curve` first reaches `target`, linearly
    interpolated in the loss between the evaluations either side; None where it never does."""
    reached = np.flatnonzero(curve.losses <= target)
    if len(reached) == 0:
        return None
    after = int(reached[0])
    if after == 0:  # no evaluation before it to interpolate from: the curve starts there
        return Crossing(float(curve.tokens[0]), float(curve.seconds[0]))
    before = after - 1
    # losses[before] > target >= losses[after]: a fraction in (0, 1].
    fraction = (curve.losses[before] - target) / (curve.losses[before] - curve.losses[after])

    def between(values: np.ndarray) -> float:
        return float(values[before] + fraction * (values[after] - values[before]))

    return Crossing(tokens=between(curve.tokens), seconds=between(curve.seconds))


@dataclass(frozen=True)
class RunMeasures:
    """What the table reports of one run, but for its crossing of the target."""

    label: str
    curve: ValidationCurve
    test_loss: Optional[float]
    tokens: float  # trained on, to the last logged iteration or the last evaluation's
    training_seconds: float  # up to that iteration
    jobs: int

    @property
    def final_validation_loss(self) -> float:
        """The validation curve's last point."""
        return float(self.curve.losses[-1])

    @property
    def tokens_per_second(self) -> float:
        """Tokens over training time."""
        return self.tokens / self.training_seconds


def measure_run(run: RunEvents, label: str) -> RunMeasures:
    """The run's validation curve against tokens and training time, and its totals."""
    clock = training_clock(run)
    valid = run.series.get(LM_LOSS_VALIDATION)
    finite = np.isfinite(valid.values) if valid is not None else np.zeros(0, dtype=bool)
    if not finite.any():
        raise RunEventsError(
            f"{run.directory}: no validation loss ('{LM_LOSS_VALIDATION}') in its event files; "
            "train it with --eval-interval and --eval-iters > 0"
        )
    iterations = valid.iterations[finite]
    curve = ValidationCurve(
        iterations=iterations,
        losses=valid.values[finite],
        tokens=run.x_values(iterations, valid.seconds[finite], "tokens"),
        seconds=clock.seconds_at(iterations),
    )
    test = run.series.get(LM_LOSS_TEST)
    # The last iteration trained: past the last logged window when --train-iters is not a
    # multiple of --log-interval (381 at 10), where the final evaluation still reports it; its
    # time is counted as the crossings past the last window are, at that window's rate.
    last = np.array([max(clock.iterations[-1], iterations[-1])])
    seconds = clock.seconds_at(last)
    return RunMeasures(
        label=label,
        curve=curve,
        test_loss=float(test.values[-1]) if test is not None else None,
        tokens=float(run.x_values(last, seconds, "tokens")[0]),
        training_seconds=float(seconds[0]),
        jobs=clock.jobs,
    )


def format_count(count: float) -> str:
    """`count` with a thousands suffix: 2.15B, 524.29M, 16.38K, 640."""
    for threshold, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= threshold:
            return f"{count / threshold:.2f}{suffix}"
    return f"{count:.0f}"


def format_duration(seconds: float) -> str:
    """`seconds` in the unit a time axis of that length uses (plot_runs.time_unit)."""
    divisor, unit = time_unit(seconds)
    return f"{seconds / divisor:.2f} {unit}"


def markdown_table(measures: Sequence[RunMeasures], crossings: Sequence[Optional[Crossing]]) -> str:
    """One row per run (module docstring); the speed-ups are over the first run."""
    reference = crossings[0]
    rows = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    for measure, crossing in zip(measures, crossings):
        cells = [
            measure.label,
            str(measure.jobs),
            f"{measure.final_validation_loss:.4f}",
            f"{measure.test_loss:.4f}" if measure.test_loss is not None else "-",
            format_count(measure.tokens),
            format_duration(measure.training_seconds),
            format_count(measure.tokens_per_second),
        ]
        if crossing is None:
            cells += [NOT_REACHED, NOT_REACHED, "-", "-"]
        else:
            cells += [format_count(crossing.tokens), format_duration(crossing.seconds)]
            if reference is None:
                cells += ["-", "-"]
            else:
                cells += [f"{reference.tokens / crossing.tokens:.2f}x",
                          f"{reference.seconds / crossing.seconds:.2f}x"]  # fmt: skip
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def loss_axis_limits(curves: Sequence[ValidationCurve], target: float) -> Tuple[float, float]:
    """(bottom, top) of the loss axis: where the curves differ (module docstring)."""
    cut = LOSS_AXIS_FROM_TOKEN_FRACTION * curves[0].tokens[-1]
    lowest = min(min(float(curve.losses.min()) for curve in curves), target)
    highest = target
    for curve in curves:
        later = curve.losses[curve.tokens >= cut]
        highest = max(highest, float(later.max() if len(later) else curve.losses[-1]))
    margin = LOSS_AXIS_MARGIN * ((highest - lowest) or abs(lowest) or 1.0)
    return lowest - margin, highest + margin


def time_to_quality_figure(
    measures: Sequence[RunMeasures], crossings: Sequence[Optional[Crossing]], target: float
) -> Figure:
    """Validation loss against tokens (left) and training time (right), the target and each
    run's crossing of it (module docstring): the figure `draw` saves, unsaved. It is no pyplot
    figure, so it needs no closing and no display."""
    import matplotlib
    from matplotlib.figure import Figure

    colours = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    figure = Figure(figsize=FIGURE_SIZE_INCHES, dpi=DPI)
    by_tokens, by_time = figure.subplots(1, 2, sharey=True)
    divisor, unit = time_unit(max(measure.curve.seconds[-1] for measure in measures))
    for index, (measure, crossing) in enumerate(zip(measures, crossings)):
        colour, curve = colours[index % len(colours)], measure.curve
        by_tokens.plot(curve.tokens, curve.losses, "o-", color=colour, label=measure.label)
        by_time.plot(curve.seconds / divisor, curve.losses, "o-", color=colour)
        if crossing is not None:
            by_tokens.plot(crossing.tokens, target, "x", markersize=12, mew=2, color=colour)
            by_time.plot(crossing.seconds / divisor, target, "x", markersize=12, mew=2,
                         color=colour)  # fmt: skip
    for panel in (by_tokens, by_time):
        panel.axhline(target, color="grey", linestyle="--", label=f"target {target:.4f}")
        panel.grid(alpha=0.3)
    by_tokens.set_ylim(*loss_axis_limits([measure.curve for measure in measures], target))
    by_tokens.set_ylabel("validation loss (lm loss validation)")
    by_tokens.set_xlabel("tokens (consumed samples x sequence length)")
    by_time.set_xlabel(f"training time ({unit}; evaluations, saves and restarts left out)")
    by_tokens.legend(fontsize="small")
    figure.suptitle("time to quality: validation loss, the target crossed at x")
    figure.tight_layout()
    return figure


def draw(
    measures: Sequence[RunMeasures],
    crossings: Sequence[Optional[Crossing]],
    target: float,
    output: str,
) -> None:
    """The picture (`time_to_quality_figure`) saved as a PNG at `output`."""
    time_to_quality_figure(measures, crossings, target).savefig(output, dpi=DPI)


def main(argv: Optional[List[str]] = None) -> int:
    """Read the runs, print the target and the table, write the PNG and print its path; 0, or 1
    after one `error: ...` line (a directory without event files or validation points, a
    missing sequence length, matplotlib not installed)."""
    args = parse_arguments(argv)
    if not args.no_plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(f"error: {MATPLOTLIB_MISSING}", file=sys.stderr, flush=True)
            return 1
    try:
        if args.labels is not None and len(args.labels) != len(args.run_directories):
            raise UserError(
                f"--labels: {len(args.labels)} labels for {len(args.run_directories)} runs; "
                "give one per RUN_DIR, in their order"
            )
        if not args.no_plot and not Path(args.output).resolve().parent.is_dir():
            raise UserError(f"--output {args.output}: its directory does not exist")
        runs = [read_run(directory, args.seq_length) for directory in args.run_directories]
        labels = args.labels or [run.name for run in runs]
        measures = [measure_run(run, label) for run, label in zip(runs, labels)]
        if args.target_loss is None:
            target = measures[0].final_validation_loss
            source = f"the final validation loss of {measures[0].label}"
        else:
            target, source = args.target_loss, "--target-loss"
        crossings = [first_crossing(measure.curve, target) for measure in measures]
        print(f"target validation loss {target:.4f} ({source})\n", flush=True)
        print(markdown_table(measures, crossings), flush=True)
        # Here, not at the top: seed_spread builds on this module's measures and crossings.
        from gpt_pretraining.seed_spread import has_seeds, seeds_table

        if has_seeds(labels):
            print(f"\nseeds: each recipe's runs against each run of {labels[0]}, the target that "
                  "run's final validation loss\n", flush=True)  # fmt: skip
            print(seeds_table(measures), flush=True)
        if not args.no_plot:
            draw(measures, crossings, target, args.output)
    except UserError as error:
        if traceback_asked():
            raise
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1
    if not args.no_plot:
        print(f"\nwrote {args.output}", flush=True)
    return 0


__all__ = [
    "DEFAULT_OUTPUT",
    "Crossing",
    "RunMeasures",
    "TrainingClock",
    "ValidationCurve",
    "draw",
    "first_crossing",
    "loss_axis_limits",
    "main",
    "markdown_table",
    "measure_run",
    "parse_arguments",
    "time_to_quality_figure",
    "training_clock",
]
