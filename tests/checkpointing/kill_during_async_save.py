"""Kill -9 pretrain_gpt.py at random moments while it saves asynchronously, and relaunch it.

    python tests/checkpointing/kill_during_async_save.py --kills 20

Each launch resumes with --load from the directory it saves to (--save-interval 1, --async-save)
and is killed with SIGKILL a random time after its first save began; most kills land while a
background write is in flight. After every kill the tracker must name a complete checkpoint, and
the next launch must load exactly that one (no corrupt load: its checksums are verified); a last
launch runs to the end. Prints one line per kill and a summary; exits non-zero on a failure.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Sequence

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from megatron.checkpointing.layout import is_complete, read_tracker  # noqa: E402
from tests import processes  # noqa: E402
from tests.tiny_gpt import tiny_gpt_args  # noqa: E402

STARTED = "copied to host memory"
FINISHED = "written in the background"
LOADED = re.compile(r"loaded checkpoint \S+ at iteration (\d+)")


def launch(args: List[str], nproc: Optional[int]) -> processes.Ranks:
    """Start pretrain_gpt.py in a process of its own, or `nproc` ranks as torchrun would
    (tests/processes.py)."""
    return processes.start(args, nproc, env=dict(os.environ, OMP_NUM_THREADS="1"))


def check_relaunch(lines: List[str], tracked: Optional[int]) -> Optional[str]:
    """None when the launch loaded the tracker's checkpoint (or started fresh without one)."""
    text = "".join(lines)
    if "error:" in text or "Traceback" in text:
        return "the relaunch failed: " + text[-2000:]
    loaded = [int(match) for match in LOADED.findall(text)]
    if tracked is None:
        return None if not loaded else f"loaded {loaded} without a tracker"
    if loaded != [tracked]:
        return f"the tracker named {tracked} but the relaunch loaded {loaded}"
    return None


def run(
    data_prefix: str,
    directory: str,
    kills: int,
    seed: int,
    window_s: float,
    nproc: Optional[int] = None,
    extra: Sequence[str] = (),
) -> int:
    """`kills` kills of one process (or of `nproc` ranks run with the flags `extra`)."""
    rng = random.Random(seed)
    save = os.path.join(directory, "checkpoints")
    args = tiny_gpt_args(
        data_prefix, "--save", save, "--load", save, "--save-interval", "1", "--async-save",
        "--eval-iters", "0", *extra, num_layers=4, hidden_size=256, train_iters=10_000,
    )  # fmt: skip
    in_flight, failures = 0, 0
    tracked = None
    for kill in range(kills):
        with launch(args, nproc) as process:
            while STARTED not in process.stdout() and process.poll() is None:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, window_s))
            process.kill(signal.SIGKILL)
            lines = (process.stdout() + process.stderr()).splitlines(keepends=True)
        failure = check_relaunch(lines, tracked)
        # Whether a background write was running when the kill came.
        writing = sum(STARTED in line for line in lines) > sum(FINISHED in line for line in lines)
        in_flight += writing
        tracked = read_tracker(save)
        if tracked is not None and not is_complete(os.path.join(save, f"iter_{tracked:07d}")):
            failure = failure or f"the tracker names {tracked}, an incomplete checkpoint"
        failures += failure is not None
        print(
            f"kill {kill + 1:2d}: {'during a background write' if writing else 'between saves'}"
            f"; the tracker names iteration {tracked}"
            + (f"; FAILED: {failure}" if failure else ""),
            flush=True,
        )
    # Two iterations past the tracker's checkpoint, and past the 2 warm-up iterations when no
    # kill left one (the learning-rate schedule needs more iterations than it warms up over).
    args[args.index("--train-iters") + 1] = str((tracked or 1) + 2)
    with launch([*args, "--use-checkpoint-opt_param-scheduler"], nproc) as process:
        returncode = process.wait()
        lines = (process.stdout() + process.stderr()).splitlines(keepends=True)
    failure = check_relaunch(lines, tracked) or (None if returncode == 0 else "exit code")
    failures += failure is not None
    print(
        f"{kills} kills, {in_flight} during a background write; the last relaunch "
        f"{'FAILED: ' + failure if failure else 'resumed and finished'}; {failures} failures"
    )
    return 1 if failures else 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=float, default=3.0, help="seconds after the first save")
    parser.add_argument(
        "--data-path", help="an indexed dataset prefix (default: the sample, built)"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        data_prefix = args.data_path
        if data_prefix is None:
            from megatron.data import preprocess
            from tests.sample_data import CORPUS, gpt2_preprocess_args

            prefix = Path(directory) / "owt"
            preprocess.main(gpt2_preprocess_args(CORPUS, prefix))
            data_prefix = f"{prefix}_text_document"
        return run(data_prefix, directory, args.kills, args.seed, args.window)


if __name__ == "__main__":
    sys.exit(main())
