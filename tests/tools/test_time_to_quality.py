"""tools/time_to_quality.py: runs written by the trainer's own TensorBoard writer with chosen
times and losses, so that every number is worked out by hand (the interpolation, a run made in
two jobs whose second logs again what the first ran past its checkpoint, a target never reached,
the default target, the test loss kept apart), then a real tiny run made in two such jobs; bad
input is one `error:` line."""

from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np
import pytest

import pretrain_gpt
from gpt_pretraining import time_to_quality
from gpt_pretraining.run_events import (
    ITERATION_TIME,
    LM_LOSS,
    LM_LOSS_TEST,
    LM_LOSS_VALIDATION,
    read_run,
)
from gpt_pretraining.time_to_quality import (
    DPI,
    FIGURE_SIZE_INCHES,
    NOT_REACHED,
    ValidationCurve,
    first_crossing,
    loss_axis_limits,
    main,
    measure_run,
    training_clock,
)
from megatron.training.logging import TEST_SUFFIX, IterationStats, TensorBoardLogger
from tests.sample_data import REPO
from tests.tiny_gpt import tensorboard_scalars, tiny_gpt_args

SEQ_LENGTH = 16
GLOBAL_BATCH = 4
TOKENS_PER_ITERATION = SEQ_LENGTH * GLOBAL_BATCH


def write_job(
    run_directory: Path,
    seconds_per_iteration: Dict[int, float],
    validation: Dict[int, float],
    test: Optional[float] = None,
) -> None:
    """One job's event file in run_directory/tensorboard, by the trainer's writer: a log window
    ending at each iteration of `seconds_per_iteration`, the validation losses after the windows
    at theirs (or later, as the final evaluation of --train-iters past the last window), and the
    test split's loss after the last."""
    writer = TensorBoardLogger(str(run_directory / "tensorboard"))
    first = min(seconds_per_iteration)
    writer.log_arguments(argparse.Namespace(seq_length=SEQ_LENGTH), first - 1)
    for iteration, seconds in seconds_per_iteration.items():
        consumed = iteration * GLOBAL_BATCH
        writer.log_training(
            IterationStats(
                iteration=iteration, train_iters=100, consumed_samples=consumed,
                elapsed_ms_per_iteration=seconds * 1000.0, learning_rate=1e-3,
                global_batch_size=GLOBAL_BATCH, losses={LM_LOSS: 5.0}, loss_scale=1.0,
                grad_norm=1.0, skipped_iterations=0, nan_iterations=0,
                tokens_per_second=TOKENS_PER_ITERATION / seconds,
                tokens_per_second_per_gpu=TOKENS_PER_ITERATION / seconds, tflops_per_gpu=1.0,
            )
        )  # fmt: skip
        if iteration in validation:
            writer.log_validation({LM_LOSS: validation[iteration]}, iteration, consumed)
    last = max(seconds_per_iteration)
    for iteration in sorted(i for i in validation if i > last):  # after a window-less stretch
        writer.log_validation({LM_LOSS: validation[iteration]}, iteration, iteration * GLOBAL_BATCH)
        last = iteration
    if test is not None:
        writer.log_validation({LM_LOSS: test}, last, last * GLOBAL_BATCH, TEST_SUFFIX)
    writer.close()


# Windows of 5 iterations; the first holds the job's warm-up (3 s per iteration) and counts at
# the median of the others, 1 s: the clock reads 5, 7.5, 12.5 and 17.5 s after iterations 5,
# 10, 15 and 20.
REFERENCE_TIMES = {5: 3.0, 10: 0.5, 15: 1.0, 20: 1.0}
REFERENCE_VALIDATION = {10: 4.0, 20: 3.0}


@pytest.fixture
def reference_run(tmp_path) -> Path:
    run = tmp_path / "reference"
    write_job(run, REFERENCE_TIMES, REFERENCE_VALIDATION)
    return run


def test_the_clock_sums_the_windows_with_each_jobs_warm_up_at_its_median(reference_run):
    clock = training_clock(read_run(str(reference_run)))
    assert clock.iterations.tolist() == [0, 5, 10, 15, 20]
    assert clock.seconds.tolist() == [0.0, 5.0, 7.5, 12.5, 17.5]
    assert clock.jobs == 1
    # Between logged iterations by interpolation, past the last at the last window's rate.
    assert clock.seconds_at(np.array([12, 22])).tolist() == pytest.approx([9.5, 19.5])


def test_the_target_is_interpolated_between_the_evaluations_around_it(reference_run):
    measures = measure_run(read_run(str(reference_run)), "reference")
    assert measures.curve.iterations.tolist() == [10, 20]
    assert measures.curve.tokens.tolist() == [10 * TOKENS_PER_ITERATION, 20 * TOKENS_PER_ITERATION]
    assert measures.curve.seconds.tolist() == [7.5, 17.5]
    # 3.25 is three quarters of the way from 4.0 (iteration 10) to 3.0 (iteration 20).
    crossing = first_crossing(measures.curve, 3.25)
    assert crossing.tokens == pytest.approx(17.5 * TOKENS_PER_ITERATION)
    assert crossing.seconds == pytest.approx(15.0)
    # At or below the target from the first evaluation: reached there; never: None.
    assert first_crossing(measures.curve, 4.5).seconds == 7.5
    assert first_crossing(measures.curve, 2.9) is None
    assert measures.final_validation_loss == 3.0 and measures.test_loss is None
    assert measures.tokens == 20 * TOKENS_PER_ITERATION and measures.training_seconds == 17.5


def test_the_totals_reach_the_last_evaluation_past_the_last_logged_window(tmp_path):
    """--train-iters 22 at --log-interval 5: the windows end at 20, the final evaluation is at
    22; the run trained 22 iterations, the last two at the last window's 1 s each."""
    run = tmp_path / "run"
    write_job(run, REFERENCE_TIMES, {**REFERENCE_VALIDATION, 22: 2.5})
    measures = measure_run(read_run(str(run)), "run")
    assert measures.tokens == 22 * TOKENS_PER_ITERATION
    assert measures.training_seconds == pytest.approx(19.5)
    assert measures.curve.seconds[-1] == pytest.approx(19.5)


def test_a_run_in_two_jobs_counts_each_iteration_once(tmp_path):
    """The first job ran iterations 1 to 4 after a start of 5 s; its checkpoint was at 2. The
    second resumed from it a while later, ran 3 to 6 again after a start of 7 s, and evaluated
    the test split at the end: iterations 3 and 4 are the second job's, its warm-up counts at
    its median (0.5 s), the first's at its other window's (1 s), the time between them not at
    all."""
    run = tmp_path / "resumed"
    write_job(run, {1: 5.0, 2: 1.0, 3: 1.0, 4: 2.0}, {2: 5.0, 4: 4.0})
    gap_seconds = 0.3
    time.sleep(gap_seconds)
    write_job(run, {3: 7.0, 4: 0.5, 5: 0.5, 6: 0.5}, {4: 3.5, 6: 3.0}, test=3.1)
    events = read_run(str(run))
    times = events.series[ITERATION_TIME]
    assert times.iterations.tolist() == [1, 2, 3, 4, 5, 6]
    assert times.values.tolist() == [5.0, 1.0, 7.0, 0.5, 0.5, 0.5]
    assert times.jobs.tolist() == [0, 0, 1, 1, 1, 1]
    assert events.series[LM_LOSS].seconds[-1] >= gap_seconds  # the wall clock holds the gap
    clock = training_clock(events)
    assert clock.seconds.tolist() == [0.0, 1.0, 2.0, 2.5, 3.0, 3.5, 4.0] and clock.jobs == 2
    measures = measure_run(events, "resumed")
    assert measures.curve.iterations.tolist() == [2, 4, 6]
    assert measures.curve.losses.tolist() == [5.0, 3.5, 3.0]  # 4 is the second job's
    assert measures.curve.seconds.tolist() == [2.0, 3.0, 4.0]
    # The test split's loss is no point of the validation curve.
    assert events.series[LM_LOSS_TEST].iterations.tolist() == [6]
    assert measures.test_loss == pytest.approx(3.1) and measures.final_validation_loss == 3.0
    assert measures.tokens_per_second == 6 * TOKENS_PER_ITERATION / 4.0


def _table_rows(printed: str) -> Dict[str, list]:
    rows = [line for line in printed.splitlines() if line.startswith("| ")]
    cells = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]
    header = cells[0]
    return {row[0]: dict(zip(header, row)) for row in cells[1:]}


def test_the_table_with_the_first_runs_final_loss_as_the_target(reference_run, tmp_path, capsys):
    """The reference reaches its final loss, 3.0, at its last evaluation (1280 tokens, 17.5 s);
    `fast` between 3.5 and 2.5, half way (800 tokens, 12.5 s); `slow` never does."""
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    write_job(fast, {5: 1.0, 10: 1.0, 15: 1.0, 20: 1.0}, {10: 3.5, 15: 2.5, 20: 2.0}, test=2.1)
    write_job(slow, REFERENCE_TIMES, {10: 4.5, 20: 3.2})
    output = tmp_path / "ttq.png"
    runs = [str(reference_run), str(fast), str(slow)]
    assert main([*runs, "--output", str(output)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(
        "target validation loss 3.0000 (the final validation loss of reference)\n"
    )
    assert printed.endswith(f"\nwrote {output}\n")
    rows = _table_rows(printed)
    assert rows["reference"] == {
        "run": "reference", "jobs": "1", "final validation loss": "3.0000", "test loss": "-",
        "tokens": "1.28K", "training time": "17.50 seconds", "tokens/s": "73",
        "tokens to target": "1.28K", "time to target": "17.50 seconds",
        "speed-up (tokens)": "1.00x", "speed-up (time)": "1.00x",
    }  # fmt: skip
    assert rows["fast"]["test loss"] == "2.1000"
    assert rows["fast"]["tokens to target"] == "800"
    assert rows["fast"]["time to target"] == "12.50 seconds"
    assert rows["fast"]["speed-up (tokens)"] == "1.60x"  # 1280 / 800
    assert rows["fast"]["speed-up (time)"] == "1.40x"  # 17.5 / 12.5
    for column in ("tokens to target", "time to target"):
        assert rows["slow"][column] == NOT_REACHED
    assert rows["slow"]["speed-up (time)"] == "-"
    # --target-loss and --labels.
    assert main([*runs, "--target-loss", "3.25", "--labels", "a", "b", "c", "--no-plot"]) == 0
    printed = capsys.readouterr().out
    rows = _table_rows(printed)
    assert printed.startswith("target validation loss 3.2500 (--target-loss)\n")
    assert "wrote" not in printed
    assert rows["a"]["time to target"] == "15.00 seconds"
    assert rows["c"]["time to target"] != NOT_REACHED  # 3.2 is below 3.25


def test_runs_of_one_label_are_seeds_set_against_each_reference_run(tmp_path, capsys):
    """Two dense seeds ending at 3.0 and 3.2 (the reference's clock: 17.5 s, 1280 tokens), two
    MoE seeds: `fast` reaches 3.0 at 800 tokens and 12.5 s and 3.2 at 736 and 11.5 s; `slow`
    ends at 3.2, so it reaches only the second dense seed's target, at its end (1.00x). The
    first dense seed reaches 3.2 at iteration 18 (1152 tokens, 15.5 s); the second never 3.0."""
    runs = {name: tmp_path / name for name in ("dense1", "dense2", "fast", "slow")}
    write_job(runs["dense1"], REFERENCE_TIMES, {10: 4.0, 20: 3.0})
    write_job(runs["dense2"], REFERENCE_TIMES, {10: 4.0, 20: 3.2})
    write_job(runs["fast"], {5: 1.0, 10: 1.0, 15: 1.0, 20: 1.0}, {10: 3.5, 15: 2.5, 20: 2.0})
    write_job(runs["slow"], REFERENCE_TIMES, {10: 4.5, 20: 3.2})
    labels = ["dense", "dense", "moe", "moe"]
    arguments = [str(path) for path in runs.values()] + ["--labels", *labels, "--no-plot"]
    assert main(arguments) == 0
    printed = capsys.readouterr().out
    seeds = printed.split("\nseeds: ")[1]
    assert seeds.startswith("each recipe's runs against each run of dense")
    rows = _table_rows(seeds)
    assert rows["dense"]["runs"] == "2"
    assert rows["dense"]["final validation loss"] == "3.1000 (3.0000-3.2000)"
    # 1.00, 1280 / 1152 and 1.00; 1.00, 17.5 / 15.5 and 1.00.
    assert rows["dense"]["speed-up (tokens)"] == "1.04x (1.00x-1.11x), 1 of 4 not reached"
    assert rows["dense"]["speed-up (time)"] == "1.04x (1.00x-1.13x), 1 of 4 not reached"
    assert rows["moe"]["final validation loss"] == "2.6000 (2.0000-3.2000)"
    # 1280 / 800, 1280 / 736 and 1.00; 17.5 / 12.5, 17.5 / 11.5 and 1.00.
    assert rows["moe"]["speed-up (tokens)"] == "1.45x (1.00x-1.74x), 1 of 4 not reached"
    assert rows["moe"]["speed-up (time)"] == "1.31x (1.00x-1.52x), 1 of 4 not reached"
    # Without a repeated label there is no second table.
    assert main([*arguments[:4], "--labels", "a", "b", "c", "d", "--no-plot"]) == 0
    assert "seeds:" not in capsys.readouterr().out


def test_the_picture(tmp_path, monkeypatch):
    """Two runs whose first evaluation (iteration 1, 64 tokens, before a tenth of the first run's
    1280) is the untrained loss: the loss axis spans the later evaluations alone, from the
    second run's 2.0 to the first's 4.0 widened by 5% of that range (0.1) either way, and leaves
    the 10.0 and 11.0 above it. The first run trains at 3 s per iteration, the second at 10 s
    (200 s in all: the time axis is in minutes). The target is the first run's final loss, 3.0:
    the first reaches it at its last evaluation, the second half way from 3.5 at iteration 10
    to 2.5 at 15 (800 tokens, 125 s)."""
    first, second = tmp_path / "first", tmp_path / "second"
    windows = (1, 5, 10, 15, 20)  # each job's first window counts at its others' median
    write_job(first, dict.fromkeys(windows, 3.0), {1: 10.0, 10: 4.0, 20: 3.0})
    write_job(second, dict.fromkeys(windows, 10.0), {1: 11.0, 10: 3.5, 15: 2.5, 20: 2.0})
    build_figure, built = time_to_quality.time_to_quality_figure, []

    def build_and_keep(*args):
        """The figure main saves, kept to be read back."""
        built.append(build_figure(*args))
        return built[-1]

    monkeypatch.setattr(time_to_quality, "time_to_quality_figure", build_and_keep)
    output = tmp_path / "ttq.png"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([str(first), str(second), "--output", str(output)]) == 0
    import matplotlib.image

    pixels = matplotlib.image.imread(str(output))
    width, height = FIGURE_SIZE_INCHES
    assert pixels.shape[:2] == (round(height * DPI), round(width * DPI))

    (figure,) = built
    by_tokens, by_time = figure.axes
    curves = [measure_run(read_run(str(run)), run.name).curve for run in (first, second)]
    limits = loss_axis_limits(curves, target=3.0)
    assert by_tokens.get_ylim() == by_time.get_ylim() == limits
    assert limits == pytest.approx((1.9, 4.1))
    assert limits[1] < min(curve.losses[0] for curve in curves)  # the untrained losses above

    def drawn(panel, marker: str) -> Tuple[list, list]:
        """The x- and the y-data of the panel's lines drawn with `marker`, in drawing order."""
        lines = [line for line in panel.get_lines() if line.get_marker() == marker]
        x_data = [list(line.get_xdata()) for line in lines]
        return x_data, [list(line.get_ydata()) for line in lines]

    losses = [curve.losses.tolist() for curve in curves]
    tokens, tokens_losses = drawn(by_tokens, "o")
    assert tokens == [curve.tokens.tolist() for curve in curves] and tokens_losses == losses
    assert tokens == [[64.0, 640.0, 1280.0], [64.0, 640.0, 960.0, 1280.0]]
    minutes, minutes_losses = drawn(by_time, "o")
    assert by_time.get_xlabel().startswith("training time (minutes;")
    assert minutes == [(curve.seconds / 60.0).tolist() for curve in curves]
    assert minutes_losses == losses
    assert minutes[0] == pytest.approx([0.05, 0.5, 1.0])
    assert minutes[1] == pytest.approx([10 / 60, 100 / 60, 150 / 60, 200 / 60])
    # Each run's cross on the target, which is a dashed line across both panels.
    assert drawn(by_tokens, "x") == ([[1280.0], [800.0]], [[3.0], [3.0]])
    crosses_minutes, crosses_losses = drawn(by_time, "x")
    assert sum(crosses_minutes, []) == pytest.approx([1.0, 125 / 60])
    assert crosses_losses == [[3.0], [3.0]]
    for panel in (by_tokens, by_time):
        dashed = [line for line in panel.get_lines() if line.get_linestyle() == "--"]
        assert [list(line.get_ydata()) for line in dashed] == [[3.0, 3.0]]


def test_the_loss_axis_leaves_out_the_initial_drop():
    """The axis spans the evaluations from 10% of the first run's tokens (10) on: the highest
    is the second run's 4.2 (at 30 tokens), the lowest the first run's 3.0; widened by 5% of
    that range either way. The untrained losses (10 and 11) are left out."""
    reference = ValidationCurve(
        iterations=np.array([0, 1, 2, 3]),
        losses=np.array([10.0, 3.8, 3.2, 3.0]),
        tokens=np.array([0.0, 20.0, 60.0, 100.0]),
        seconds=np.zeros(4),
    )
    other = ValidationCurve(
        iterations=np.array([0, 1, 2]),
        losses=np.array([11.0, 4.2, 3.1]),
        tokens=np.array([0.0, 30.0, 100.0]),
        seconds=np.zeros(3),
    )
    assert loss_axis_limits([reference, other], target=3.0) == pytest.approx((2.94, 4.26))
    # A target below every loss is on the axis too; a run with no evaluation past the cut is
    # bounded by its last.
    early = ValidationCurve(np.array([0, 1]), np.array([12.0, 5.0]), np.array([1.0, 2.0]),
                            np.zeros(2))  # fmt: skip
    assert loss_axis_limits([reference, early], target=2.5) == pytest.approx((2.375, 5.125))


def _error_line(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    error = captured.err
    assert error.startswith("error: ") and error.count("\n") == 1, error
    return error.strip()


def test_bad_input_is_one_error_line(reference_run, tmp_path, capsys):
    empty = tmp_path / "not_a_run"
    (empty / "tensorboard").mkdir(parents=True)
    assert main([str(reference_run), str(empty), "--no-plot"]) == 1
    assert _error_line(capsys).startswith(f"error: {empty}: no TensorBoard event files")
    unevaluated = tmp_path / "unevaluated"
    write_job(unevaluated, REFERENCE_TIMES, {})
    assert main([str(unevaluated), "--no-plot"]) == 1
    error = _error_line(capsys)
    assert (
        str(unevaluated) in error and "no validation loss" in error and "--eval-interval" in error
    )
    assert main([str(reference_run), "--labels", "a", "b", "--no-plot"]) == 1
    assert _error_line(capsys).startswith("error: --labels: 2 labels for 1 runs")
    assert main([str(reference_run), "--output", str(tmp_path / "missing" / "x.png")]) == 1
    assert "its directory does not exist" in _error_line(capsys)


def test_a_run_without_iteration_times_is_one_error_line(tmp_path, capsys):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "old_run" / "tensorboard"))
    for iteration in (1, 2):
        writer.add_scalar(LM_LOSS, 10.0 - iteration, iteration)
        writer.add_scalar(LM_LOSS_VALIDATION, 10.0 - iteration, iteration)
    writer.close()
    assert main([str(tmp_path / "old_run"), "--no-plot"]) == 1
    error = _error_line(capsys)
    assert "old_run" in error and f"no '{ITERATION_TIME}' scalar" in error


def test_without_matplotlib_the_tool_says_to_install_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(["anything"]) == 1
    assert capsys.readouterr().err == f"error: {time_to_quality.MATPLOTLIB_MISSING}\n"


@pytest.fixture(scope="module")
def resumed_tiny_run(data_prefix, tmp_path_factory) -> Path:
    """A tiny GPT of 6 iterations in two jobs: the first saves at 2 and 4 and stops at 4; its
    checkpoint of 4 is then taken as never written (the tracker set back to 2, as a job killed
    between the two saves leaves it), so the second resumes from 2 and logs 3 and 4 again.
    Evaluated at 2, 4 and 6, and after training."""
    run = tmp_path_factory.mktemp("time_to_quality") / "tiny"
    save = run / "checkpoints"
    common = ["--tensorboard-dir", str(run / "tensorboard"), "--save", str(save),
              "--save-interval", "2"]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        first = pretrain_gpt.main(
            tiny_gpt_args(
                data_prefix, *common, "--exit-interval", "4", train_iters=6, eval_interval=2
            )
        )
        assert first.iteration == 4
        (save / "latest_checkpointed_iteration.txt").write_text("2")
        second = pretrain_gpt.main(
            tiny_gpt_args(data_prefix, *common, "--load", str(save), train_iters=6, eval_interval=2)
        )
    assert second.iteration == 6 and len(second.losses) == 4  # iterations 3 to 6
    return run


def test_a_real_run_in_two_jobs(resumed_tiny_run):
    events = read_run(str(resumed_tiny_run))
    files = sorted((resumed_tiny_run / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 2
    times = events.series[ITERATION_TIME]
    assert times.iterations.tolist() == [1, 2, 3, 4, 5, 6]
    assert times.jobs.tolist() == [0, 0, 1, 1, 1, 1]
    # What each job wrote, read from its own event file: iterations 3 and 4 are the second's.
    first, second = (tensorboard_scalars(path, [ITERATION_TIME])[ITERATION_TIME] for path in files)
    assert sorted(first) == [1, 2, 3, 4] and sorted(second) == [3, 4, 5, 6]
    assert times.values.tolist() == [first[1], first[2], *(second[i] for i in (3, 4, 5, 6))]
    clock = training_clock(events)
    expected = (
        first[2] * 2 + np.median([second[i] for i in (4, 5, 6)]) + sum(second[i] for i in (4, 5, 6))
    )
    assert clock.seconds[-1] == pytest.approx(expected) and clock.jobs == 2
    measures = measure_run(events, "tiny")
    assert measures.curve.iterations.tolist() == [2, 4, 6]
    assert events.series[LM_LOSS_VALIDATION].jobs.tolist() == [0, 1, 1]
    # The test split's loss: under its own tag, no point of the validation curve.
    test = tensorboard_scalars(files[1], [LM_LOSS_TEST])[LM_LOSS_TEST]
    assert list(test) == [6] and measures.test_loss == test[6]
    assert measures.test_loss not in measures.curve.losses.tolist()


def test_the_command_line_runs(resumed_tiny_run, tmp_path):
    """tools/time_to_quality.py as a user runs it, from another directory (the default --output
    is the current directory's)."""
    finished = subprocess.run(
        [sys.executable, str(REPO / "tools" / "time_to_quality.py"), str(resumed_tiny_run),
         str(resumed_tiny_run / "tensorboard"), "--labels", "one", "two"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert finished.returncode == 0, finished.stderr[-3000:]
    rows = _table_rows(finished.stdout)
    assert rows["one"]["jobs"] == rows["two"]["jobs"] == "2"
    assert rows["two"]["speed-up (time)"] == "1.00x"
    assert (tmp_path / "time_to_quality.png").stat().st_size > 10_000
