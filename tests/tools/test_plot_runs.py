"""tools/plot_runs.py on the event files of one real tiny dMoE run: the values it reads are the
run's iteration lines, its x axes are iterations, consumed samples x sequence length and
wall-clock seconds, its PNG is a real picture, and bad input is one `error:` line."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys

import numpy as np
import pytest

import pretrain_gpt
from gpt_pretraining import plot_runs
from gpt_pretraining.plot_runs import DPI, PANEL_SIZE_INCHES, main, spread_layers
from gpt_pretraining.run_events import (
    LM_LOSS,
    LM_LOSS_TEST,
    LM_LOSS_VALIDATION,
    TOKENS_PER_SECOND_PER_GPU,
    read_run,
)
from tests.sample_data import REPO
from tests.tiny_gpt import tensorboard_scalars, tiny_gpt_args

SEQ_LENGTH = 32
GLOBAL_BATCH = 4
ITERATIONS = 4
NUM_EXPERTS = 4
MOE_LAYERS = (0, 2)  # 4 layers, an MoE layer every other one
ITERATION_LINE = re.compile(
    r" iteration +(\d+)/ +\d+ \| consumed samples: +(\d+) \|.*? lm loss: ([0-9.E+-]+) \|"
)
VALIDATION_LINE = re.compile(r" validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")
TEST_LINE = re.compile(
    r" validation loss at the end of training for test data \| lm loss value: (\S+) "
)

pytestmark = pytest.mark.usefixtures("reference_kernels")


@pytest.fixture(scope="module")
def dmoe_run(data_prefix, tmp_path_factory):
    """One tiny dMoE run laid out as examples/common.sh lays it out (OUTPUT_DIR/tensorboard)
    and what it printed; an evaluation at iteration 2 and at the end."""
    run_directory = tmp_path_factory.mktemp("plot") / "tiny_dmoe"
    args = tiny_gpt_args(
        data_prefix,
        "--seq-length", str(SEQ_LENGTH), "--max-position-embeddings", str(SEQ_LENGTH),
        "--num-layers", "4", "--moe-num-experts", str(NUM_EXPERTS), "--moe-top-k", "2",
        "--moe-layer-freq", "2", "--tensorboard-dir", str(run_directory / "tensorboard"),
        train_iters=ITERATIONS, micro_batch=2, global_batch=GLOBAL_BATCH, eval_interval=2,
    )  # fmt: skip
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        pretrain_gpt.main(args)
    return run_directory, printed.getvalue()


def assert_printed(values: np.ndarray, printed: list) -> None:
    """`values` (TensorBoard's float32) are the `printed` numbers (7 significant digits, from
    the float64 mean): equal to within half the last printed digit plus float32's rounding."""
    assert values.tolist() == pytest.approx([float(text) for text in printed], rel=6e-7)


def test_the_losses_read_are_the_iteration_lines(dmoe_run):
    run_directory, output = dmoe_run
    run = read_run(str(run_directory))
    lines = ITERATION_LINE.findall(output)
    assert len(lines) == ITERATIONS, output[-3000:]
    train = run.series[LM_LOSS]
    assert train.iterations.tolist() == [int(i) for i, _, _ in lines]
    assert_printed(train.values, [loss for _, _, loss in lines])
    # The validations at iterations 2 and 4 (the one after training, at 4 too, comes after);
    # the test split's loss under its own name.
    validations = VALIDATION_LINE.findall(output)
    valid = run.series[LM_LOSS_VALIDATION]
    assert valid.iterations.tolist() == [2, ITERATIONS]
    assert_printed(valid.values, [loss for _, loss in validations[:2]])
    test = run.series[LM_LOSS_TEST]
    assert test.iterations.tolist() == [ITERATIONS]
    assert_printed(test.values, TEST_LINE.findall(output))
    assert run.series[TOKENS_PER_SECOND_PER_GPU].values.min() > 0
    assert run.name == "tiny_dmoe" and run.seq_length == SEQ_LENGTH


def test_the_x_axes(dmoe_run):
    run_directory, output = dmoe_run
    run = read_run(str(run_directory / "tensorboard"))  # the tensorboard/ itself
    assert run.name == "tiny_dmoe"
    train = run.series[LM_LOSS]
    samples = [int(consumed) for _, consumed, _ in ITERATION_LINE.findall(output)]
    assert samples == [GLOBAL_BATCH * (i + 1) for i in range(ITERATIONS)]
    tokens = run.x_values(train.iterations, train.seconds, "tokens")
    assert tokens.tolist() == [s * SEQ_LENGTH for s in samples]
    valid = run.series[LM_LOSS_VALIDATION]
    assert run.x_values(valid.iterations, valid.seconds, "tokens").tolist() == [
        2 * GLOBAL_BATCH * SEQ_LENGTH,
        ITERATIONS * GLOBAL_BATCH * SEQ_LENGTH,
    ]
    assert run.x_values(train.iterations, train.seconds, "iterations").tolist() == [1, 2, 3, 4]
    seconds = run.x_values(train.iterations, train.seconds, "time")
    assert 0 < seconds[0] and np.all(np.diff(seconds) >= 0) and seconds[-1] < 600
    # --seq-length overrides what the run recorded.
    assert read_run(str(run_directory), seq_length=8).x_values(
        train.iterations, train.seconds, "tokens"
    ).tolist() == [s * 8 for s in samples]


def test_the_expert_load_is_each_experts_share_of_its_layer(dmoe_run):
    run = read_run(str(dmoe_run[0]))
    assert sorted(run.expert_load) == list(MOE_LAYERS)
    for load in run.expert_load.values():
        assert load.iterations.tolist() == list(range(1, ITERATIONS + 1))
        assert load.over_mean_EP.shape == (NUM_EXPERTS, ITERATIONS)
        # Tokens over the mean: the experts' values average to 1 at every iteration.
        np.testing.assert_allclose(load.over_mean_EP.mean(axis=0), 1.0, rtol=1e-6)
    # Which expert got which share: each layer's largest and smallest share is the one the run
    # logged for that layer (from its own counts, moe.expert_load.load_spread), iteration by
    # iteration, and the layers' loads differ.
    names = [f"moe/tokens-per-expert {end}-over-mean layer {n}" for n in MOE_LAYERS for end in
             ("max", "min")]  # fmt: skip
    logged = tensorboard_scalars(dmoe_run[0] / "tensorboard", names)
    for layer, load in run.expert_load.items():
        for end, reduce in (("max", np.max), ("min", np.min)):
            spread = logged[f"moe/tokens-per-expert {end}-over-mean layer {layer}"]
            expected = [spread[i] for i in load.iterations.tolist()]
            np.testing.assert_allclose(reduce(load.over_mean_EP, axis=0), expected, rtol=1e-6)
    first, second = (run.expert_load[layer].over_mean_EP for layer in MOE_LAYERS)
    assert not np.array_equal(first, second)


@pytest.mark.parametrize("axis", ["iterations", "tokens", "time"])
def test_the_png_is_a_picture_of_the_expected_size(dmoe_run, tmp_path, axis, capsys):
    import matplotlib.image

    output = tmp_path / f"{axis}.png"
    assert main([str(dmoe_run[0]), "--x", axis, "--output", str(output)]) == 0
    assert capsys.readouterr().out == f"wrote {output}\n"
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(str(output))
    panels = 2 + len(MOE_LAYERS)  # loss, throughput, a heatmap per MoE layer
    width, height = PANEL_SIZE_INCHES
    assert pixels.shape[:2] == (round(height * panels * DPI), round(width * DPI))
    colours = np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)
    assert len(colours) > 50, len(colours)  # lines, text and a colour map, not a blank page


def test_two_runs_share_one_picture(dmoe_run, tmp_path):
    """A dense run beside the dMoE (here the same run under two names, one without heatmaps)."""
    import matplotlib.image

    output = tmp_path / "two.png"
    run = str(dmoe_run[0])
    assert main([run, run + "/tensorboard", "--expert-load-layers", "1", "--output",
                 str(output)]) == 0  # fmt: skip
    panels = 2 + 2  # each run's first MoE layer
    assert matplotlib.image.imread(str(output)).shape[0] == round(
        PANEL_SIZE_INCHES[1] * panels * DPI
    )


def test_spread_layers_keeps_the_first_and_the_last():
    assert spread_layers([1, 3, 5, 7, 9, 11], 3) == [1, 5, 11]
    assert spread_layers([1, 3], 4) == [1, 3] and spread_layers([1, 3], 0) == []


def test_a_directory_without_event_files_is_one_error_line(tmp_path, capsys):
    empty = tmp_path / "not_a_run"
    (empty / "tensorboard").mkdir(parents=True)
    assert main([str(empty)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    error = captured.err.strip()
    assert error.startswith(f"error: {empty}: no TensorBoard event files") and "\n" not in error
    assert main([str(tmp_path / "missing")]) == 1
    assert "no such directory" in capsys.readouterr().err


def test_a_run_that_logged_no_arguments_needs_seq_length_for_tokens(tmp_path, capsys):
    """Event files of a run older than the arguments in TensorBoard: iterations plot, tokens
    ask for --seq-length in one line, and with it they plot."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "old_run" / "tensorboard"))
    for iteration in (1, 2):
        writer.add_scalar(LM_LOSS, 10.0 - iteration, iteration)
        writer.add_scalar(LM_LOSS + " vs samples", 10.0 - iteration, 8 * iteration)
    writer.close()
    run = str(tmp_path / "old_run")
    output = str(tmp_path / "old.png")
    assert main([run, "--output", output]) == 0
    capsys.readouterr()
    assert main([run, "--x", "tokens", "--output", output]) == 1
    error = capsys.readouterr().err
    assert "record no seq_length" in error and "--seq-length" in error and error.count("\n") == 1
    assert main([run, "--x", "tokens", "--seq-length", "16", "--output", output]) == 0
    old = read_run(run, seq_length=16)
    series = old.series[LM_LOSS]
    assert old.x_values(series.iterations, series.seconds, "tokens").tolist() == [128, 256]


def test_without_matplotlib_the_tool_says_to_install_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(["anything"]) == 1
    assert capsys.readouterr().err == f"error: {plot_runs.MATPLOTLIB_MISSING}\n"


def test_the_command_line_runs(dmoe_run, tmp_path):
    """tools/plot_runs.py as a user runs it, from another directory (the default --output is
    the current directory's)."""
    finished = subprocess.run(
        [sys.executable, str(REPO / "tools" / "plot_runs.py"), str(dmoe_run[0]), "--x", "time"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert (tmp_path / "runs_plot.png").stat().st_size > 10_000
