"""What a tiny run writes to TensorBoard beside Megatron's log lines: the test split's loss
after training under a name of its own (`lm loss test`), not as one more point of `lm loss
validation`; and the seconds per iteration of every log window (`iteration-time`), which leave
out the evaluations and checkpoint saves between the iterations."""

from __future__ import annotations

import contextlib
import io
import math
import re
import time

import pytest

import pretrain_gpt
from megatron.training.trainer import Trainer
from tests.tiny_gpt import tiny_gpt_args

GLOBAL_BATCH = 8
ITERATIONS = 4
# The first evaluation and the first checkpoint save (after iteration 2) are each slowed by this
# much: a window that counted them would be 2 x this longer, far beyond how much two tiny
# iterations differ on a loaded machine (0.6 s seen with 0.5 s pauses on every call).
PAUSE_SECONDS = 2.0
ITERATION_LINE = re.compile(
    r" iteration +(\d+)/ +\d+ \|.* elapsed time per iteration \(ms\): ([0-9.]+) \|"
)
VALIDATION_LINE = re.compile(r" validation loss at (.+?) \| lm loss value: ([0-9.E+-]+)")


@pytest.fixture(scope="module")
def tiny_run(data_prefix, tmp_path_factory):
    """A tiny GPT of 4 iterations, evaluated at iterations 2 and 4 and after training (both
    splits), saved at 2 and at the end: its TensorBoard directory and what it printed."""
    root = tmp_path_factory.mktemp("tensorboard_scalars")
    args = tiny_gpt_args(
        data_prefix, "--tensorboard-dir", str(root / "tensorboard"), "--save",
        str(root / "checkpoints"), "--save-interval", "2",
        train_iters=ITERATIONS, global_batch=GLOBAL_BATCH, micro_batch=4, eval_interval=2,
    )  # fmt: skip
    evaluate, save = Trainer.evaluate, Trainer.save
    paused = set()

    def pause_once(name):
        if name not in paused:
            paused.add(name)
            time.sleep(PAUSE_SECONDS)

    def slow_evaluate(self, *args, **kwargs):
        pause_once("evaluate")
        return evaluate(self, *args, **kwargs)

    def slow_save(self, *args, **kwargs):
        pause_once("save")
        return save(self, *args, **kwargs)

    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(Trainer, "evaluate", slow_evaluate)
        patch.setattr(Trainer, "save", slow_save)
        pretrain_gpt.main(args)
    return root / "tensorboard", printed.getvalue()


def _events(directory, tag):
    """Every (step, value) the run wrote under `tag`, in order, repeated steps kept."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


def test_the_test_loss_has_a_tag_of_its_own(tiny_run):
    directory, printed = tiny_run
    losses = {where: float(value) for where, value in VALIDATION_LINE.findall(printed)}
    # Megatron's log block is unchanged: four evaluations, the test split's last.
    assert list(losses) == [
        "iteration 2",
        "iteration 4",
        "the end of training for val data",
        "the end of training for test data",
    ]
    validation = _events(directory, "lm loss validation")
    assert [step for step, _ in validation] == [2, ITERATIONS, ITERATIONS]
    assert [value for _, value in validation] == pytest.approx(
        [losses["iteration 2"], losses["iteration 4"], losses["the end of training for val data"]],
        rel=6e-7,
    )
    test_loss = losses["the end of training for test data"]
    assert _events(directory, "lm loss test") == [(ITERATIONS, pytest.approx(test_loss, rel=6e-7))]
    ((step, perplexity),) = _events(directory, "lm loss test ppl")
    assert step == ITERATIONS and perplexity == pytest.approx(math.exp(test_loss), rel=1e-6)
    samples = ITERATIONS * GLOBAL_BATCH
    assert [step for step, _ in _events(directory, "lm loss test vs samples")] == [samples]
    assert [step for step, _ in _events(directory, "lm loss test ppl vs samples")] == [samples]


def test_the_iteration_time_is_the_log_lines_without_evaluations_or_saves(tiny_run):
    directory, printed = tiny_run
    lines = {int(i): float(ms) / 1000.0 for i, ms in ITERATION_LINE.findall(printed)}
    logged = dict(_events(directory, "iteration-time"))
    assert sorted(logged) == sorted(lines) == list(range(1, ITERATIONS + 1))
    # The log line rounds the milliseconds to one decimal.
    for iteration, seconds in lines.items():
        assert logged[iteration] == pytest.approx(seconds, abs=6e-5), iteration
    # The evaluation and the save after iteration 2 (a pause each) are not in the window of
    # iteration 3, which takes about as long as iteration 4's (whose window has no pause).
    assert logged[3] < logged[4] + PAUSE_SECONDS, logged
