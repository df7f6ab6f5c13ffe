"""One PNG comparing training runs from their TensorBoard event files: the library of
tools/plot_runs.py (its flags, `parse_arguments`; its entry, `main`).

Panels, top to bottom, all sharing the x axis (--x iterations, tokens or time):
1. training loss (`lm loss`, solid), validation loss (`lm loss validation`, dots on a dashed
   line) and the test split's loss after training (`lm loss test`, a star, no point of the
   validation line), one colour per run, labelled by the run directory's name;
2. throughput, tokens per second per GPU;
3. for each run with MoE layers, a heatmap of each expert's tokens over its layer's mean
   (experts x logged iterations; 1.0 is perfect balance) for up to --expert-load-layers of its
   MoE layers, spread from the first to the last.
What is read and how the x axis is computed: gpt_pretraining/run_events.py.

matplotlib is an optional extra (`pip install -e '.[plot]'`); the figure is drawn with the Agg
backend, so no display is needed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from gpt_pretraining.run_events import (
    LM_LOSS,
    LM_LOSS_TEST,
    LM_LOSS_VALIDATION,
    TOKENS_PER_SECOND_PER_GPU,
    X_AXES,
    RunEvents,
    RunEventsError,
    read_run,
)
from megatron.errors import UserError, traceback_asked

# In the current directory, not a run's: a picture of several runs belongs to none of them.
DEFAULT_OUTPUT = "runs_plot.png"
PANEL_SIZE_INCHES = (10.0, 3.2)  # width, height of each panel
DPI = 100
X_LABELS = {"iterations": "iterations", "tokens": "tokens (consumed samples x sequence length)"}
MATPLOTLIB_MISSING = (
    "tools/plot_runs.py needs matplotlib, an optional extra: pip install -e '.[plot]'"
)


def parse_arguments(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """tools/plot_runs.py's flags."""
    parser = argparse.ArgumentParser(
        prog="tools/plot_runs.py",
        description="Plot training runs' loss, throughput and expert load from TensorBoard.",
    )
    parser.add_argument(
        "run_directories",
        nargs="+",
        metavar="RUN_DIR",
        help="a run's output directory (holding tensorboard/) or its --tensorboard-dir",
    )
    parser.add_argument("--x", choices=X_AXES, default="iterations", help="the x axis")
    parser.add_argument(
        "--output", default=DEFAULT_OUTPUT, help=f"the PNG to write (default ./{DEFAULT_OUTPUT})"
    )
    parser.add_argument(
        "--seq-length",
        type=int,
        default=None,
        help="tokens per sample for --x tokens, for runs whose event files do not record it",
    )
    parser.add_argument(
        "--expert-load-layers",
        type=int,
        default=4,
        help="MoE layers per run drawn as expert-load heatmaps (default 4; 0: none)",
    )
    return parser.parse_args(argv)


def time_unit(longest_seconds: float) -> Tuple[float, str]:
    """(divisor, name) that keeps a wall-clock axis of `longest_seconds` readable."""
    if longest_seconds >= 3 * 3600:
        return 3600.0, "hours"
    if longest_seconds >= 3 * 60:
        return 60.0, "minutes"
    return 1.0, "seconds"


def spread_layers(layers: Sequence[int], count: int) -> List[int]:
    """Up to `count` of `layers`, evenly spread from the first to the last."""
    if count >= len(layers):
        return list(layers)
    if count <= 0:
        return []
    positions = np.linspace(0, len(layers) - 1, count).round().astype(int)
    return [layers[p] for p in sorted(set(positions.tolist()))]


def window_edges(x: np.ndarray) -> np.ndarray:
    """[points + 1] cell edges for counts logged at `x`: each cell spans the logging window
    that ends at its point, from the point before (the first as long as the second)."""
    first_width = x[1] - x[0] if len(x) > 1 else 1.0
    return np.concatenate([[x[0] - first_width], x])


def draw(runs: Sequence[RunEvents], axis: str, output: str, expert_load_layers: int) -> None:
    """Draw the runs' panels (module docstring) and save them as a PNG at `output`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    heatmaps = [(run, layer) for run in runs for layer in spread_layers(
        sorted(run.expert_load), expert_load_layers
    )]  # fmt: skip
    panels = 2 + len(heatmaps)
    width, height = PANEL_SIZE_INCHES
    figure = plt.figure(figsize=(width, height * panels), dpi=DPI)
    # A narrow column for the heatmaps' colour bars, empty beside the line panels: every panel
    # is then as wide as the others and their shared x axes line up.
    grid = figure.add_gridspec(panels, 2, width_ratios=(50, 1))
    axes = [figure.add_subplot(grid[0, 0])]
    axes += [figure.add_subplot(grid[row, 0], sharex=axes[0]) for row in range(1, panels)]
    x_of, x_label = _x_axis(runs, axis)
    _draw_lines(axes[0], axes[1], runs, x_of, plt.rcParams["axes.prop_cycle"].by_key()["color"])
    # One colour scale for every heatmap, so that layers and runs compare at a glance.
    highest = max(
        [np.nanmax(run.expert_load[layer].over_mean_EP) for run, layer in heatmaps] or [1]
    )
    for row, (run, layer) in enumerate(heatmaps, start=2):
        load = run.expert_load[layer]
        experts = load.over_mean_EP.shape[0]
        mesh = axes[row].pcolormesh(window_edges(x_of(run, load.iterations, load.seconds)),
                                    np.arange(experts + 1) - 0.5, load.over_mean_EP,
                                    cmap="viridis", vmin=0.0, vmax=highest)  # fmt: skip
        mesh.sticky_edges.x[:] = []  # keep the margins of the line panels it shares x with
        figure.colorbar(mesh, cax=figure.add_subplot(grid[row, 1]), label="tokens over the mean")
        axes[row].set_ylabel("expert")
        axes[row].yaxis.set_major_locator(MaxNLocator(integer=True))
        axes[row].set_title(f"{run.name}: expert load, MoE layer {layer}")
    for panel in axes[:-1]:
        panel.tick_params(labelbottom=False)
    axes[-1].set_xlabel(x_label)
    figure.tight_layout()
    figure.savefig(output, dpi=DPI)
    plt.close(figure)


def _x_axis(runs: Sequence[RunEvents], axis: str) -> Tuple[Callable, str]:
    """(x_of(run, iterations, seconds) -> positions, the axis label) for --x `axis`."""
    scale, label = 1.0, X_LABELS.get(axis, "")
    if axis == "time":
        longest = max(series.seconds.max() for run in runs for series in run.series.values())
        scale, unit = time_unit(longest)
        label = f"wall-clock time since the run started ({unit})"

    def x_of(run: RunEvents, iterations: np.ndarray, seconds: np.ndarray) -> np.ndarray:
        return run.x_values(iterations, seconds, axis) / scale

    return x_of, label


def _draw_lines(loss_axes, throughput_axes, runs: Sequence[RunEvents], x_of, colours) -> None:
    """The loss and throughput panels: one colour per run."""
    for index, run in enumerate(runs):
        colour = colours[index % len(colours)]
        train = run.series[LM_LOSS]
        loss_axes.plot(x_of(run, train.iterations, train.seconds), train.values,
                       color=colour, label=f"{run.name} training")  # fmt: skip
        if LM_LOSS_VALIDATION in run.series:
            valid = run.series[LM_LOSS_VALIDATION]
            loss_axes.plot(x_of(run, valid.iterations, valid.seconds), valid.values, "o--",
                           color=colour, label=f"{run.name} validation")  # fmt: skip
        if LM_LOSS_TEST in run.series:
            test = run.series[LM_LOSS_TEST]
            loss_axes.plot(x_of(run, test.iterations, test.seconds), test.values, "*",
                           markersize=12, color=colour, label=f"{run.name} test")  # fmt: skip
        if TOKENS_PER_SECOND_PER_GPU in run.series:
            speed = run.series[TOKENS_PER_SECOND_PER_GPU]
            throughput_axes.plot(x_of(run, speed.iterations, speed.seconds), speed.values,
                                 color=colour, label=run.name)  # fmt: skip
    loss_axes.set_ylabel("lm loss")
    loss_axes.set_title("training (solid), validation (dots) and test (star) loss")
    throughput_axes.set_ylabel("tokens / s / GPU")
    throughput_axes.set_title("throughput")
    for panel in (loss_axes, throughput_axes):
        panel.grid(alpha=0.3)
        if panel.has_data():
            panel.legend(fontsize="small")


def main(argv: Optional[List[str]] = None) -> int:
    """Read the runs, write the PNG and print its path; 0, or 1 after one `error: ...` line
    (a directory without event files, a missing sequence length, matplotlib not installed)."""
    args = parse_arguments(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"error: {MATPLOTLIB_MISSING}", file=sys.stderr, flush=True)
        return 1
    try:
        if not Path(args.output).resolve().parent.is_dir():
            raise RunEventsError(f"--output {args.output}: its directory does not exist")
        runs = [read_run(directory, args.seq_length) for directory in args.run_directories]
        draw(runs, args.x, args.output, args.expert_load_layers)
    except UserError as error:
        if traceback_asked():
            raise
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1
    print(f"wrote {args.output}", flush=True)
    return 0


__all__ = ["DEFAULT_OUTPUT", "draw", "main", "parse_arguments"]
