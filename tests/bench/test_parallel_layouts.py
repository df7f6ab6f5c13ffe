"""bench/parallel_layouts.py without training: the trainer's lines read into windows, the EP
block factor in effect per window, the steady windows and their tables, --data-path's refusal."""

from pathlib import Path

import pytest

from bench import parallel_layouts
from bench.parallel_layouts import (
    Result,
    Row,
    Window,
    factor_summary,
    initial_block_factor,
    progress_line,
    read_line,
    steady,
    windows_table,
)
from megatron.training.logging import IterationStats, format_iteration_line

REPO_ROOT = Path(__file__).resolve().parents[2]
# moe.training_hooks.IMBALANCE_FIELD (not imported: the bench reads text, not the package).
IMBALANCE_FIELD = "expert-parallel load imbalance"


def iteration_line(iteration, ms, lm_loss, tokens_per_gpu, imbalance=None):
    """The trainer's iteration line, from its own formatter."""
    stats = IterationStats(
        iteration=iteration,
        train_iters=400,
        consumed_samples=iteration * 256,
        elapsed_ms_per_iteration=ms,
        learning_rate=6e-4,
        global_batch_size=256,
        losses={"lm loss": lm_loss, "load balancing loss": 0.1},
        loss_scale=1.0,
        grad_norm=0.5,
        skipped_iterations=0,
        nan_iterations=0,
        tokens_per_second=tokens_per_gpu * 4,
        tokens_per_second_per_gpu=tokens_per_gpu,
        tflops_per_gpu=123.4,
        extra={} if imbalance is None else {IMBALANCE_FIELD: imbalance},
    )
    return format_iteration_line(stats) + "\n"


# The notes' exact text: moe.training_hooks.MoETrainingHooks.rerun_step, and the trainer's
# wrapper of a rerun's note (megatron.training.trainer); test_notes_follow_the_trainer checks
# that the sources still say this.
def shrink_note(old, smaller, window_need=1.2, shrink_window=100):
    return (
        f"note: the expert-parallel blocks shrink: the last {shrink_window} "
        f"iterations needed at most {window_need:.2f}x the balanced share in their "
        f"fullest block; the buffer factor goes from {old} to {smaller}\n"
    )


def grow_note(iteration, old, factor, ratio=1.37):
    note = (
        f"the expert-parallel blocks were {ratio:.2f}x too small for its routing; "
        f"the buffer factor grows from {old} to {factor} (pass "
        f"--moe-expert-parallel-buffer-factor {factor} to start there)"
    )
    return f"note: iteration {iteration} runs again: {note}\n"


def test_notes_follow_the_trainer():
    hooks = (REPO_ROOT / "moe" / "training_hooks.py").read_text()
    assert "the buffer factor goes from {old} to {smaller}" in hooks
    assert "the buffer factor grows from {old} to {factor} (pass " in hooks
    trainer = (REPO_ROOT / "megatron" / "training" / "trainer.py").read_text()
    assert "note: iteration {self.iteration + 1} runs again: {note}" in trainer


def test_windows_carry_the_factor_in_effect_when_logged():
    row = Row.parse("EP4=dmoe_125m_8gpu:4:--moe-expert-parallel-buffer-factor 1.5")
    result = Result(row, returncode=-1, block_factor=initial_block_factor(row))
    lines = [
        "> building train, validation, and test datasets ...\n",
        iteration_line(25, 410.2, 7.25, 150123, imbalance=1.412),
        iteration_line(50, 401.7, 6.5, 152000, imbalance=1.305),
        grow_note(63, 1.5, 2.25),
        iteration_line(75, 455.0, 6.1, 140000, imbalance=1.288),
        iteration_line(100, 430.0, 5.9, 145000, imbalance=1.201),
        shrink_note(2.25, 1.75),
        iteration_line(125, 420.0, 5.7, 148000, imbalance=1.19),
        "[after training is done] datetime: 2026-12-02 10:00:00\n",
    ]
    read = [read_line(result, line) for line in lines]

    assert [w is not None for w in read] == [
        False,
        True,
        True,
        False,
        True,
        True,
        False,
        True,
        False,
    ]
    assert [w.iteration for w in result.windows] == [25, 50, 75, 100, 125]
    assert [w.imbalance for w in result.windows] == [1.412, 1.305, 1.288, 1.201, 1.19]
    assert [w.block_factor for w in result.windows] == [1.5, 1.5, 2.25, 2.25, 1.75]
    assert result.block_factor == 1.75
    first = result.windows[0]
    assert (first.ms, first.lm_loss, first.tokens_per_gpu) == (410.2, 7.25, 150123)
    assert result.last_line == "[after training is done] datetime: 2026-12-02 10:00:00"


def test_an_unknown_factor_is_learned_from_the_first_note():
    result = Result(Row.parse("EP4=no_such_script:4"), returncode=-1)
    assert initial_block_factor(result.row) is None
    for line in [
        iteration_line(25, 400.0, 7.0, 150000, imbalance=1.4),
        iteration_line(50, 400.0, 6.8, 150000, imbalance=1.3),
        shrink_note(2.0, 1.25),
        iteration_line(75, 390.0, 6.6, 152000, imbalance=1.2),
    ]:
        read_line(result, line)
    assert [w.block_factor for w in result.windows] == [2.0, 2.0, 1.25]


def test_windows_without_expert_parallelism_carry_neither():
    result = Result(Row.parse("DP4=dmoe_125m_8gpu:4"), returncode=-1)
    window = read_line(result, iteration_line(25, 380.0, 7.0, 160000))
    assert (window.imbalance, window.block_factor) == (None, None)
    assert progress_line("DP4", window) == "   DP4 it 25: 380.0 ms, 160000 tok/s/GPU"


def test_initial_block_factor_follows_argparse():
    flag = "--moe-expert-parallel-buffer-factor"
    assert initial_block_factor(Row("r", "dmoe_125m_8gpu", 4, [flag, "1.5"])) == 1.5
    assert initial_block_factor(Row("r", "dmoe_125m_8gpu", 4, [f"{flag}=2"])) == 2.0
    assert initial_block_factor(Row("r", "dmoe_125m_8gpu", 4, [flag, "1.5", flag, "3"])) == 3.0
    # examples/common.sh appends EXTRA_ARGS after the row's flags.
    row = Row("r", "dmoe_125m_8gpu", 4, [flag, "1.5"])
    assert initial_block_factor(row, f"--bf16 {flag} 1.25") == 1.25


def test_progress_line_shows_imbalance_and_factor():
    window = Window(275, 401.25, 5.5, 151234, 1.3104, 1.5)
    assert progress_line("EP4", window) == (
        "   EP4 it 275: 401.2 ms, 151234 tok/s/GPU, imbalance 1.310, factor 1.50"
    )


def windows_at(iterations, factors):
    return [Window(i, 400.0 + i, 6.0, 150000 + i, 1.2, f) for i, f in zip(iterations, factors)]


def test_steady_windows_start_at_steady_from():
    iterations = list(range(25, 401, 25))
    result = Result(Row("r", "s", 4, []), 0, windows_at(iterations, [1.5] * len(iterations)))
    assert [w.iteration for w in steady(result, 250, 25)] == [275, 300, 325, 350, 375, 400]
    assert [w.iteration for w in steady(result, 260, 25)] == [300, 325, 350, 375, 400]


def test_factor_summary():
    assert factor_summary(windows_at([275, 300], [2.25, 2.25])) == "2.25"
    assert factor_summary(windows_at([275, 300, 325], [2.25, 1.5, 1.75])) == "1.50–2.25"
    assert factor_summary(windows_at([275, 300], [None, None])) == ""


def test_windows_table_lists_each_steady_window():
    ep = Result(Row("EP4", "s", 4, []), 0, windows_at([225, 250, 275, 300], [2.25, 2.25, 1.5, 1.5]))
    dp = Result(Row("DP4", "s", 4, []), 0, [Window(275, 380.0, 6.0, 160000, None, None)])
    lines = windows_table([ep, dp], 250, 25)
    assert lines[0].startswith("| layout | iteration | ms / iteration | tokens/s per GPU |")
    assert lines[2:] == [
        "| EP4 | 275 | 675.0 | 150,275 | 1.200 | 1.50 |",
        "| EP4 | 300 | 700.0 | 150,300 | 1.200 | 1.50 |",
        "| DP4 | 275 | 380.0 | 160,000 |  |  |",
    ]


def test_data_path_refuses_a_missing_prefix(tmp_path):
    missing = tmp_path / "nowhere" / "corpus_text_document"
    log_dir = tmp_path / "logs"
    argv = ["--data-path", str(missing), "--log-dir", str(log_dir), "EP4=dmoe_125m_8gpu:4"]
    with pytest.raises(SystemExit) as refusal:
        parallel_layouts.main(argv)
    message = str(refusal.value)
    assert message.startswith(f"--data-path {missing}: {missing}.idx not found")
    assert "\n" not in message
    assert not log_dir.exists()


def test_data_path_says_to_decompress_a_packed_bin(tmp_path):
    prefix = tmp_path / "g124_text_document"
    Path(f"{prefix}.idx").write_bytes(b"")
    Path(f"{prefix}.bin.xz.part0").write_bytes(b"")
    with pytest.raises(SystemExit) as refusal:
        parallel_layouts.main(["--data-path", str(prefix), "EP4=dmoe_125m_8gpu:4"])
    assert str(refusal.value) == (
        f"--data-path {prefix}: {prefix}.bin not found; decompress it first: "
        f"cat {prefix}.bin.xz.part* | xz -dc -T0 > {prefix}.bin"
    )
