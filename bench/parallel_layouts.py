"""Training throughput of the example scripts at several layouts, side by side on one machine.

Each row runs an examples/*.sh script through torchrun, as a user would, on the bundled corpus
(tokenized first if missing) without checkpoints, and reads Megatron's iteration lines. The
table gives the mean of the windows logged after --steady-from iterations (routing settles in
the first hundred or so), tokens/s per GPU, the ratio to the row named by --baseline, and under
expert parallelism the load imbalance the log line carries.

    python -m bench.parallel_layouts --train-iters 160 --log-interval 20 --steady-from 100 \\
        --log-dir /tmp/layouts \\
        "dense DP4=gpt2_125m_8gpu:4" \\
        "dMoE DP4 + dist-opt=dmoe_125m_8gpu:4:--use-distributed-optimizer" \\
        "dMoE EP4=dmoe_125m_8gpu:4:--expert-model-parallel-size 4"

A row is LABEL=SCRIPT:NPROC[:FLAGS], FLAGS appended to the script's (they win).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_PREFIX = REPO_ROOT / "data" / "owt" / "owt_text_document"
ITERATION = re.compile(
    r" iteration +(\d+)/ *\d+ \|.*elapsed time per iteration \(ms\): ([0-9.]+) \|"
    r".*lm loss: ([0-9.E+-]+) \|.*tokens per second per GPU: ([0-9]+) \|"
)
IMBALANCE = re.compile(r"expert-parallel load imbalance: ([0-9.]+) \|")


@dataclass
class Row:
    label: str
    script: str
    nproc: int
    flags: List[str]

    @classmethod
    def parse(cls, text: str) -> Row:
        label, _, spec = text.partition("=")
        parts = spec.split(":", 2)
        if not label or len(parts) < 2 or not parts[1].isdigit():
            raise SystemExit(f"row {text!r}: expected LABEL=SCRIPT:NPROC[:FLAGS]")
        flags = shlex.split(parts[2]) if len(parts) == 3 else []
        return cls(label, parts[0], int(parts[1]), flags)


@dataclass
class Window:
    iteration: int
    ms: float
    lm_loss: float
    tokens_per_gpu: float
    imbalance: Optional[float]


@dataclass
class Result:
    row: Row
    returncode: int
    windows: List[Window] = field(default_factory=list)
    last_line: str = ""


def ensure_data() -> None:
    if not DATA_PREFIX.with_suffix(".idx").is_file():
        print("data/owt missing: running examples/data_preprocessing.sh", flush=True)
        subprocess.run(["bash", str(REPO_ROOT / "examples" / "data_preprocessing.sh")], check=True)


def run_row(row: Row, args: argparse.Namespace, log_dir: Path) -> Result:
    name = re.sub(r"[^A-Za-z0-9]+", "_", row.label).strip("_")
    output_dir = Path("/tmp") / f"parallel_layouts_{name}_{os.getpid()}"
    command = [
        "bash", str(REPO_ROOT / "examples" / f"{row.script}.sh"),
        str(DATA_PREFIX), str(REPO_ROOT / "data/sample/gpt2-vocab.json"),
        str(REPO_ROOT / "data/sample/gpt2-merges.txt"), str(output_dir),
        "--save", "", "--load", "", "--eval-iters", "0",
        "--train-iters", str(args.train_iters), "--log-interval", str(args.log_interval),
        *row.flags,
    ]  # fmt: skip
    env = dict(os.environ, NPROC_PER_NODE=str(row.nproc), PYTHONUNBUFFERED="1")
    result = Result(row, returncode=-1)
    log_path = log_dir / f"{name}.log"
    started = time.time()
    print(f"== {row.label}: {shlex.join(command)}", flush=True)
    with open(log_path, "w") as log, subprocess.Popen(
        command, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    ) as process:  # fmt: skip
        for line in process.stdout:
            log.write(line)
            match = ITERATION.search(line)
            if match:
                imbalance = IMBALANCE.search(line)
                window = Window(
                    int(match.group(1)), float(match.group(2)), float(match.group(3)),
                    float(match.group(4)), float(imbalance.group(1)) if imbalance else None,
                )  # fmt: skip
                result.windows.append(window)
                print(
                    f"   {row.label} it {window.iteration}: {window.ms:.1f} ms, "
                    f"{window.tokens_per_gpu:.0f} tok/s/GPU"
                    + (f", imbalance {window.imbalance:.3f}" if window.imbalance else ""),
                    flush=True,
                )
            if line.strip():
                result.last_line = line.strip()
        result.returncode = process.wait()
    print(
        f"   {row.label}: exit {result.returncode} after {time.time() - started:.0f} s", flush=True
    )
    return result


def steady(result: Result, steady_from: int, log_interval: int) -> List[Window]:
    """The windows that start at or after iteration `steady_from`."""
    return [w for w in result.windows if w.iteration - log_interval >= steady_from]


def mean(values: List[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", nargs="+", help="LABEL=SCRIPT:NPROC[:FLAGS]")
    parser.add_argument("--train-iters", type=int, default=160)
    parser.add_argument("--log-interval", type=int, default=20)
    parser.add_argument(
        "--steady-from", type=int, default=100,
        help="Average the windows that start at or after this iteration.",
    )  # fmt: skip
    parser.add_argument("--baseline", default=None, help="Label of the row ratios refer to.")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/parallel_layouts"))
    args = parser.parse_args(argv)
    rows = [Row.parse(text) for text in args.rows]
    args.log_dir.mkdir(parents=True, exist_ok=True)
    ensure_data()
    results = [run_row(row, args, args.log_dir) for row in rows]
    baseline = next((r for r in results if r.row.label == args.baseline), None)
    base_tokens = (
        mean([w.tokens_per_gpu for w in steady(baseline, args.steady_from, args.log_interval)])
        if baseline
        else None
    )

    print()
    print(f"windows from iteration {args.steady_from}; logs in {args.log_dir}")
    header = "| layout | GPUs | windows | ms / iteration | tokens/s per GPU | × baseline | EP imbalance | lm loss (last) |"
    print(header)
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    failed = 0
    for result in results:
        windows = steady(result, args.steady_from, args.log_interval)
        if result.returncode != 0 or not windows:
            failed += 1
            print(
                f"| {result.row.label} | {result.row.nproc} | failed (exit {result.returncode}): {result.last_line[:120]} |"
            )
            continue
        tokens = mean([w.tokens_per_gpu for w in windows])
        imbalances = [w.imbalance for w in windows if w.imbalance is not None]
        ratio = f"{tokens / base_tokens:.3f}" if base_tokens else ""
        imbalance = f"{mean(imbalances):.3f}" if imbalances else ""
        print(
            f"| {result.row.label} | {result.row.nproc} | {len(windows)} | "
            f"{mean([w.ms for w in windows]):.1f} | {tokens:,.0f} | {ratio} | {imbalance} | "
            f"{result.windows[-1].lm_loss:.4f} |"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
