"""What a checkpoint costs training in each format: torch, torch_dist, torch_dist --async-save.

Runs pretrain_gpt.py with the given flags once per format, saving once at --save-iteration and
training to --train-iters, and reads its log: the time training was blocked by the save (its
`save-checkpoint` timer), the time until the checkpoint was complete (the same for a blocking
save; the blocked time plus the background write for --async-save), and the iteration times
before and after the save (the iteration after the save includes the time it blocked, as
Megatron's timing window spans the save). The run is stopped (SIGKILL) once its last iteration
is logged and its checkpoint complete, so no second checkpoint is written; a second run then
loads the saved one (`load-checkpoint` timer, from the page cache when it fits in memory). One
checkpoint is on disk at a time. The mode "torch_dist --async-save, no checksums" saves without checksums (its
files are not read back to be hashed), and "most dirty GB" is the most page cache the kernel
held dirty or under writeback during the training run: what a background write competes with.

    python bench/checkpoint_formats.py --save-dir /tmp/ckpt -- \\
        --num-layers 12 --hidden-size 768 ... --data-path ... --vocab-file ... --merge-file ...
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional

REPO = Path(__file__).resolve().parents[1]
MODES = {
    "torch": ["--ckpt-format", "torch"],
    "torch_dist": ["--ckpt-format", "torch_dist"],
    "torch_dist --async-save": ["--ckpt-format", "torch_dist", "--async-save"],
    # The same without checksums (the files are not read back to hash them): to tell what the
    # hashing costs the iterations beside a background write.
    "torch_dist --async-save, no checksums": ["--ckpt-format", "torch_dist", "--async-save"],
}
WITHOUT_CHECKSUMS = "--run-without-checksums"
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


def run(
    flags: List[str], stop_at: Optional[int], log_path: Path, async_save: bool, checksums: bool
) -> tuple:
    """pretrain_gpt.py's output, stopped by SIGKILL once iteration `stop_at` is logged (and an
    asynchronous checkpoint is complete), and the most page cache that was dirty meanwhile."""
    entry = [str(REPO / "pretrain_gpt.py")] if checksums else [__file__, WITHOUT_CHECKSUMS]
    most_dirty = [0]
    sampling = [True]

    def sample() -> None:
        while sampling[0]:
            most_dirty[0] = max(most_dirty[0], dirty_bytes())
            time.sleep(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    process = subprocess.Popen(
        [sys.executable, *entry, *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines = []
    for line in process.stdout:
        lines.append(line)
        print(line, end="", flush=True)
        done = [int(m.group(1)) for m in map(ITERATION.search, lines) if m]
        finished = not async_save or any(BACKGROUND.search(text) for text in lines)
        if stop_at is not None and done and done[-1] >= stop_at and finished:
            os.killpg(process.pid, signal.SIGKILL)
            break
    process.wait()
    sampling[0] = False
    sampler.join()
    output = "".join(lines)
    log_path.write_text(output)
    return output, most_dirty[0]


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
        output, dirty = run(
            [*common, "--train-iters", str(args.train_iters)],
            args.train_iters,
            Path(args.log_dir) / f"{name}_train.log",
            "--async-save" in mode,
            checksums,
        )
        saves = [float(slowest) for kind, _, slowest in TIMER.findall(output) if kind == "save"]
        background = [float(seconds) for seconds in BACKGROUND.findall(output)]
        times = {int(i): float(ms) for i, ms in ITERATION.findall(output)}
        size = sum(f.stat().st_size for f in Path(args.save_dir).rglob("*") if f.is_file())
        load_output, _ = run(
            [
                *common,
                "--train-iters",
                str(args.save_iteration),
                "--load",
                args.save_dir,
                "--use-checkpoint-opt_param-scheduler",
            ],  # fmt: skip
            None,
            Path(args.log_dir) / f"{name}_load.log",
            False,
            checksums,
        )
        loads = [
            float(slowest) for kind, _, slowest in TIMER.findall(load_output) if kind == "load"
        ]
        blocked = saves[0] / 1e3 if saves else float("nan")
        before = [times[i] for i in range(2, args.save_iteration) if i in times]
        # The iteration after the save includes the time it blocked training (Megatron's
        # timing window spans it); the ones after that run beside a background write.
        after = [
            times[i] for i in range(args.save_iteration + 2, args.train_iters + 1) if i in times
        ]
        rows.append(
            (
                mode,
                size / 1e9,
                blocked,
                blocked + (background[0] if background else 0.0),
                loads[0] / 1e3 if loads else float("nan"),
                statistics.median(before) if before else float("nan"),
                statistics.median(after) if after else float("nan"),
                times.get(args.save_iteration + 1, float("nan")),
                dirty / 1e9,
            )
        )
    shutil.rmtree(args.save_dir, ignore_errors=True)
    print(
        f"\n{'format':<38} {'GB':>6} {'blocked s':>10} {'complete s':>11} {'load s':>7} "
        f"{'iter ms before':>15} {'iter ms with save':>18} {'iter ms after':>14} "
        f"{'most dirty GB':>14}"
    )
    for mode, gigabytes, blocked, complete, load, before, after, with_save, dirty in rows:
        print(
            f"{mode:<38} {gigabytes:6.1f} {blocked:10.2f} {complete:11.2f} {load:7.2f} "
            f"{before:15.1f} {with_save:18.1f} {after:14.1f} {dirty:14.1f}"
        )


def run_without_checksums(flags: List[str]) -> None:
    """pretrain_gpt.py whose saves record no checksums (`save_checkpoint(checksums=False)`)."""
    sys.path.insert(0, str(REPO))
    import pretrain_gpt
    from megatron import trainer
    from megatron.checkpointing import save_checkpoint

    trainer.save_checkpoint = functools.partial(save_checkpoint, checksums=False)
    pretrain_gpt.main(flags)


if __name__ == "__main__":
    if sys.argv[1:2] == [WITHOUT_CHECKSUMS]:
        run_without_checksums(sys.argv[2:])
    else:
        main()
