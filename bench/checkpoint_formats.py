"""What a checkpoint costs training in each format: torch, torch_dist, torch_dist --async-save.

Runs pretrain_gpt.py with the given flags once per format, saving once, at --save-iteration (the
saves that --save-interval and the end of training would add are left out), training to
--train-iters, and reads its log as it comes, each line timed on arrival:

- blocked: the time training was blocked by the save (its `save-checkpoint` timer);
- complete: from the save until the checkpoint is complete (the blocked time plus the
  background write's own duration);
- load: a second run's `load-checkpoint` timer (from the page cache when the checkpoint fits in
  memory);
- iteration 2: the step after which --async-save page-locks its host buffers;
- iterations before the save, during the background write (those logged after the save's and
  before the checkpoint was complete) and after it; "slower" compares the median during the
  write with the median of those before and after (none of which has a save beside it).

The run is stopped (SIGKILL) once its last iteration is logged and its checkpoint complete. One
checkpoint is on disk at a time. The mode "torch_dist --async-save, no checksums" saves without
checksums (its files are not read back to be hashed), and "most dirty GB" is the most page cache
the kernel held dirty or under writeback during the training run.

    python -m bench.checkpoint_formats --save-dir /tmp/ckpt --train-iters 40 -- \\
        --num-layers 12 --hidden-size 768 ... --data-path ... --vocab-file ... --merge-file ...
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from megatron.checkpointing.layout import read_tracker

REPO = Path(__file__).resolve().parents[1]

MODES = {
    "torch": ["--ckpt-format", "torch"],
    "torch_dist": ["--ckpt-format", "torch_dist"],
    "torch_dist --async-save": ["--ckpt-format", "torch_dist", "--async-save"],
    # The same without checksums (the files are not read back to hash them): to tell what the
    # hashing costs the iterations beside a background write.
    "torch_dist --async-save, no checksums": ["--ckpt-format", "torch_dist", "--async-save"],
}
PRETRAIN_SAVING_ONCE = "--pretrain-saving-once"
ITERATION = re.compile(r" iteration +(\d+)/ +\d+ \| .*elapsed time per iteration \(ms\): ([0-9.]+)")
TIMER = re.compile(r"    (save|load)-checkpoint \.+: \(([0-9.]+), ([0-9.]+)\)")
BACKGROUND = re.compile(r"written in the background in ([0-9.]+) s")


def dirty_bytes() -> int:
    """The kernel's dirty and under-writeback page cache (/proc/meminfo), in bytes."""
    fields = {}
    with open("/proc/meminfo") as file:
        for line in file:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0]) * 1024
    return fields.get("Dirty", 0) + fields.get("Writeback", 0)


@dataclass
class Run:
    """One pretrain_gpt.py run: its output, when each line arrived, and what was sampled."""

    output: str = ""
    iterations: Dict[int, float] = field(default_factory=dict)  # ms, from the log
    logged_at: Dict[int, float] = field(default_factory=dict)  # perf_counter seconds
    saved_at: Optional[float] = None  # when the save's timer line arrived (training resumed)
    complete_at: Optional[float] = None  # when the tracker first named the saved iteration
    most_dirty: int = 0


def run(
    flags: List[str],
    save_dir: str,
    save_iteration: int,
    stop_at: Optional[int],
    log_path: Path,
    checksums: bool,
) -> Run:
    """pretrain_gpt.py saving once, at `save_iteration`; stopped by SIGKILL once iteration
    `stop_at` is logged and the checkpoint is complete."""
    result = Run()
    sampling = [True]

    def sample() -> None:
        while sampling[0]:
            result.most_dirty = max(result.most_dirty, dirty_bytes())
            if result.complete_at is None and read_tracker(save_dir) == save_iteration:
                result.complete_at = time.perf_counter()
            time.sleep(0.2)

    already = read_tracker(save_dir) == save_iteration  # a load run
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    entry = ["-m", "bench.checkpoint_formats", PRETRAIN_SAVING_ONCE, str(save_iteration)]
    # PYTHONPATH: `-m bench...` from the checkout, whatever the working directory.
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    process = subprocess.Popen(
        [sys.executable, *entry, str(int(checksums)), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath},
    )
    lines = []
    for line in process.stdout:
        now = time.perf_counter()
        lines.append(line)
        print(line, end="", flush=True)
        timer = TIMER.search(line)
        if result.saved_at is None and timer is not None and timer.group(1) == "save":
            result.saved_at = now
        match = ITERATION.search(line)
        if match:
            result.iterations[int(match.group(1))] = float(match.group(2))
            result.logged_at[int(match.group(1))] = now
        done = max(result.iterations, default=0)
        complete = already or read_tracker(save_dir) == save_iteration
        if stop_at is not None and done >= stop_at and complete:
            os.killpg(process.pid, signal.SIGKILL)
            break
    process.wait()
    sampling[0] = False
    sampler.join()
    result.output = "".join(lines)
    log_path.write_text(result.output)
    return result


def median(values: List[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--save-dir", required=True, help="emptied first; one checkpoint at a time")
    parser.add_argument("--save-iteration", type=int, default=4)
    parser.add_argument("--train-iters", type=int, default=8)
    parser.add_argument("--log-dir", default=".", help="where each run's log goes")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="pretrain_gpt.py flags after --")
    args = parser.parse_args()
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    rows = []
    for mode in args.modes:
        shutil.rmtree(args.save_dir, ignore_errors=True)
        name = re.sub(r"[^a-z_]+", "_", mode)
        common = [*flags, *MODES[mode], "--save", args.save_dir, "--log-interval", "1"]
        common += ["--save-interval", str(args.save_iteration)]
        checksums = "no checksums" not in mode
        trained = run(
            [*common, "--train-iters", str(args.train_iters)],
            args.save_dir,
            args.save_iteration,
            args.train_iters,
            Path(args.log_dir) / f"{name}_train.log",
            checksums,
        )
        size = sum(f.stat().st_size for f in Path(args.save_dir).rglob("*") if f.is_file())
        loaded = run(
            [
                *common,
                "--train-iters",
                str(args.save_iteration),
                "--load",
                args.save_dir,
                "--use-checkpoint-opt_param-scheduler",
            ],  # fmt: skip
            args.save_dir,
            args.save_iteration,
            None,
            Path(args.log_dir) / f"{name}_load.log",
            checksums,
        )
        rows.append(
            (
                mode,
                size / 1e9,
                *summarize(trained, loaded, args.save_iteration, "--async-save" in mode),
            )
        )
    shutil.rmtree(args.save_dir, ignore_errors=True)
    print(
        f"\n{'format':<38} {'GB':>5} {'blocked s':>9} {'complete s':>10} {'load s':>7} "
        f"{'iter 2 s':>8} {'before s':>8} {'during s (n)':>13} {'after s (n)':>12} "
        f"{'slower':>7} {'dirty GB':>8}"
    )
    for mode, gigabytes, blocked, complete, load, second, before, during, after, dirty in rows:
        slower = during[0] / median(before + after[2]) - 1 if during[1] else float("nan")
        print(
            f"{mode:<38} {gigabytes:5.1f} {blocked:9.2f} {complete:10.2f} {load:7.2f} "
            f"{second:8.2f} {median(before):8.2f} {during[0]:8.2f} ({during[1]:2d}) "
            f"{after[0]:7.2f} ({after[1]:2d}) {slower:+7.1%} {dirty:8.1f}"
        )


def summarize(trained: Run, loaded: Run, save_iteration: int, asynchronous: bool) -> tuple:
    """The table's numbers for one format (times in seconds); `asynchronous`: --async-save."""
    saves = [float(slowest) for kind, _, slowest in TIMER.findall(trained.output) if kind == "save"]
    loads = [float(slowest) for kind, _, slowest in TIMER.findall(loaded.output) if kind == "load"]
    blocked = saves[0] / 1e3 if saves else float("nan")
    # A blocking save is complete when training resumes; a background write, when the tracker
    # names it (sampled every 0.2 s), or as its own completion line says.
    background = [float(seconds) for seconds in BACKGROUND.findall(trained.output)]
    complete = blocked
    if background:
        complete += background[0]
    elif asynchronous and trained.saved_at is not None and trained.complete_at is not None:
        complete += max(0.0, trained.complete_at - trained.saved_at)
    seconds = {i: ms / 1e3 for i, ms in trained.iterations.items()}
    before = [seconds[i] for i in range(3, save_iteration + 1) if i in seconds]
    during, after = [], []
    # The iteration after the save holds the time it blocked training (Megatron's timing
    # window spans the save); the ones after it ran beside the background write or after it.
    for i in sorted(seconds):
        if i <= save_iteration + 1:
            continue
        written = trained.complete_at is not None and trained.logged_at[i] > trained.complete_at
        (after if written or trained.complete_at is None else during).append(seconds[i])
    return (
        blocked,
        complete,
        loads[0] / 1e3 if loads else float("nan"),
        seconds.get(2, float("nan")),
        before,
        (median(during), len(during)),
        (median(after), len(after), after),
        trained.most_dirty / 1e9,
    )


def pretrain_saving_once(save_iteration: int, checksums: bool, flags: List[str]) -> None:
    """pretrain_gpt.py whose only save is at `save_iteration` (without checksums when
    `checksums` is false)."""
    from gpt_pretraining.pretrain import main as pretrain_main
    from megatron.checkpointing import save_checkpoint
    from megatron.training import trainer

    def save_once(config, iteration, *args, **kwargs):
        if iteration != save_iteration:
            return None
        return save_checkpoint(config, iteration, *args, checksums=checksums, **kwargs)

    trainer.save_checkpoint = save_once
    pretrain_main(flags)


if __name__ == "__main__":
    if sys.argv[1:2] == [PRETRAIN_SAVING_ONCE]:
        pretrain_saving_once(int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4:])
    else:
        main()
