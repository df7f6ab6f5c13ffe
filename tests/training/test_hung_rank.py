"""A rank that stops answering: the others stop once --distributed-timeout-minutes has passed,
with one line naming what they waited in and the rank that never arrived, and the tracker
still names a complete checkpoint."""

from __future__ import annotations

import os
import time

from megatron.checkpointing.layout import is_complete, read_tracker
from tests import processes
from tests.sample_data import REPO
from tests.tiny_gpt import tiny_gpt_args

HANG = str(REPO / "tests" / "training" / "hang_in_step.py")
TIMEOUT_MINUTES = 0.2  # 12 s: setup (index building) must not time out on 2 slow cores


def test_a_hung_rank_is_named_and_the_others_stop(data_prefix, tmp_path):
    save = tmp_path / "ckpt"
    args = tiny_gpt_args(
        data_prefix, "--save", str(save), "--save-interval", "2", "--eval-iters", "0",
        "--distributed-timeout-minutes", str(TIMEOUT_MINUTES),
        train_iters=6, seq_length=32, micro_batch=2, global_batch=4,
    )  # fmt: skip
    environment = dict(os.environ, OMP_NUM_THREADS="1", HANG_RANK="1", HANG_ITERATION="3")
    started = time.monotonic()
    finished = processes.run(args, 2, script=HANG, env=environment, timeout=240)
    elapsed = time.monotonic() - started
    assert finished.returncode == 1, finished.stdout[-2000:] + finished.stderr[-3000:]
    errors = [line for line in finished.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, finished.stderr[-3000:]
    error = errors[0]
    assert error.startswith(
        "error: rank 0 waited 0.2 min (--distributed-timeout-minutes) in the gradient "
        "reduction during backward, called from megatron/training/trainer.py:"
    ), error
    assert "during iteration 3; rank 1 never arrived (last seen: rank 1 at iteration 3)" in error
    assert f"the latest checkpoint is {save / 'iter_0000002'}: restart the job" in error
    assert read_tracker(str(save)) == 2 and is_complete(str(save / "iter_0000002"))
    assert elapsed < 120, elapsed  # not the hour the hung rank sleeps
