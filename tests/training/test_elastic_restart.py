"""A rank killed mid-run under `torchrun --max-restarts`: torchrun restarts the job, which
resumes from the latest complete checkpoint and trains on to the losses of a run that was never
interrupted. Two gloo ranks on this machine, five SIGKILLs at random moments of two jobs (one
saving synchronously, one with --async-save): at an iteration, during a save, and during the
background write of an --async-save, each job meeting every moment it has."""

from __future__ import annotations

import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Tuple

import psutil
import pytest

from megatron.checkpointing.layout import is_complete, read_tracker
from tests import processes
from tests.sample_data import REPO
from tests.tiny_gpt import tiny_gpt_args

ITERATIONS = 16
LOSS = re.compile(r" iteration +(\d+)/ *\d+ \|.*?lm loss: ([0-9.E+-]+) \|")
# What a (re)started run says it starts from (megatron.checkpointing.load).
START = re.compile(r"loaded checkpoint \S+ at iteration (\d+)|training from scratch")


def _args(data_prefix: str, *extra: str) -> List[str]:
    return tiny_gpt_args(
        data_prefix, "--eval-iters", "0", *extra, train_iters=ITERATIONS, seq_length=32,
        micro_batch=2, global_batch=4,
    )  # fmt: skip


def _losses(output: str) -> Dict[int, List[str]]:
    """Every loss each iteration logged (an iteration run again after a restart logs again),
    as printed: equal strings are equal losses to the printed precision."""
    found: Dict[int, List[str]] = {}
    for iteration, loss in LOSS.findall(output):
        found.setdefault(int(iteration), []).append(loss)
    return found


class _Job:
    """torchrun with restarts, its output read line by line into a queue."""

    def __init__(self, args: List[str], max_restarts: int) -> None:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", "2", "--max-restarts", str(max_restarts),
            str(REPO / "pretrain_gpt.py"), *args,
        ]  # fmt: skip
        environment = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: List[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.output.append(line)
            self.lines.put(line)
        self.lines.put("")  # the end

    def wait_for(self, pattern: re.Pattern, deadline: float) -> re.Match:
        while True:
            line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line == "":
                raise AssertionError("the job ended early:\n" + "".join(self.output)[-4000:])
            match = pattern.search(line)
            if match:
                return match

    def kill_a_worker(self, rng: random.Random) -> int:
        workers = [p for p in psutil.Process(self.process.pid).children() if p.is_running()]
        assert len(workers) == 2, workers
        victim = rng.choice(workers)
        os.kill(victim.pid, signal.SIGKILL)
        return victim.pid


class _Restart(NamedTuple):
    """A kill and the restart after it: the iteration the tracker named when the rank died
    and the one the restart loaded (None: no checkpoint yet, and a start from scratch)."""

    moment: str
    named: Optional[int]
    loaded: Optional[int]


def _run_with_kills(
    args: List[str], save: Path, moments: List[str], seed: int
) -> Tuple[str, List[_Restart]]:
    """The job with a SIGKILL at each of `moments`, each after the previous kill's restart is
    training again; the job's whole output and its restarts. Counted from the iteration the
    run (re)started at: "iteration" kills during iteration 3 or later (a checkpoint of
    iteration 2 is written by then), "save" during the first save (after an even iteration),
    "background write" while an --async-save's write goes on."""
    rng = random.Random(seed)
    job = _Job(args, max_restarts=len(moments) + 2)
    deadline = time.monotonic() + 240  # a restart that hangs fails here
    iteration_line = re.compile(r" iteration +(\d+)/")
    started_at = 0
    restarts = []
    try:
        for moment in moments:
            if moment == "iteration":
                while int(job.wait_for(iteration_line, deadline).group(1)) < started_at + 3:
                    pass
                time.sleep(rng.uniform(0.0, 0.3))
            elif moment == "save":  # the save follows the line of an even iteration
                while int(job.wait_for(iteration_line, deadline).group(1)) % 2:
                    pass
                time.sleep(rng.uniform(0.0, 0.05))
            else:  # --async-save: the write goes on after this line
                job.wait_for(re.compile(r"written in the background"), deadline)
            job.kill_a_worker(rng)
            # What the restart will load: the tracker names a complete checkpoint, or none.
            named = read_tracker(str(save)) if save.exists() else None
            if named is not None:
                assert is_complete(str(save / f"iter_{named:07d}")), named
            loaded = job.wait_for(START, deadline).group(1)
            restarts.append(_Restart(moment, named, None if loaded is None else int(loaded)))
            started_at = restarts[-1].loaded or 0
        job.process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if job.process.poll() is None:
            job.process.kill()
    output = "".join(job.output)
    assert job.process.returncode == 0, output[-4000:]
    return output, restarts


@pytest.fixture(scope="module")
def expected(data_prefix) -> Dict[int, str]:
    """The losses of the run never interrupted."""
    reference = processes.run(_args(data_prefix), 2, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert reference.returncode == 0, reference.stderr[-3000:]
    losses = {iteration: losses[0] for iteration, losses in _losses(reference.stdout).items()}
    assert sorted(losses) == list(range(1, ITERATIONS + 1))
    return losses


@pytest.mark.parametrize("saving", ["sync", "async"])
def test_killed_ranks_restart_from_the_latest_checkpoint_with_the_same_losses(
    data_prefix, tmp_path, saving, expected
):
    save = tmp_path / "ckpt"
    flags = ["--save", str(save), "--load", str(save), "--save-interval", "2"]
    if saving == "async":
        flags.append("--async-save")
        moments = ["background write", "iteration", "save"]
    else:
        moments = ["iteration", "save"]
    output, restarts = _run_with_kills(_args(data_prefix, *flags), save, moments, seed=len(saving))

    # Each restart loads the checkpoint the tracker named when the rank died (or a newer one
    # the other rank completed); from scratch only when there was none. A kill during an
    # iteration comes after a save, so those restarts load one.
    assert len(START.findall(output)) == len(moments) + 1  # the first start, then each restart
    for restart in restarts:
        if restart.named is None:
            assert restart.loaded is None or restart.loaded > 0, restarts
        else:
            assert restart.loaded is not None and restart.loaded >= restart.named, restarts
        if restart.moment == "iteration":
            assert restart.named is not None, restarts
    logged = _losses(output)
    assert sorted(logged) == list(range(1, ITERATIONS + 1))
    bad = {
        iteration: (losses, expected[iteration])
        for iteration, losses in logged.items()
        if any(loss != expected[iteration] for loss in losses)
    }
    assert not bad, bad  # every run of every iteration, before and after each restart
    assert read_tracker(str(save)) == ITERATIONS
