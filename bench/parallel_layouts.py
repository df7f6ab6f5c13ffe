"""Training throughput of the example scripts at several layouts, side by side on one machine;
the measurement protocol for expert parallelism (EP).

Each row runs an examples/*.sh script through torchrun, as a user would, on --data-path (by
default the bundled sample, tokenized first if missing) without checkpoints, and reads
Megatron's iteration lines. The table gives the mean of the windows logged after --steady-from
iterations, tokens/s per GPU, the ratio to the row named by --baseline, and under expert
parallelism the load imbalance the log line carries and the block factor in effect
(--moe-expert-parallel-buffer-factor, which the run grows or shrinks and announces in notes);
--windows-table adds a line per steady window, so that a reader sees routing had settled.

EP is judged after routing settles: by about iteration 250 at global batch 256 on Gutenberg
(124M tokens, ../shared/data/gutenberg/README.md). On the bundled 1M-token sample the learning
rate decays before routing settles, so EP is not judged there. Gutenberg's .bin is shipped
xz-compressed in parts: decompress it first (beside a copy of the .idx where that folder is
read-only):

    cat ../shared/data/gutenberg/g124_text_document.bin.xz.part* | xz -dc -T0 \\
        > ../shared/data/gutenberg/g124_text_document.bin
    G="--global-batch-size 256"
    D="--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
    E="--expert-model-parallel-size 4 --moe-expert-parallel-buffer-factor 1.5"
    E="$E --moe-expert-parallel-chunked-overlap"
    python -m bench.parallel_layouts --data-path ../shared/data/gutenberg/g124_text_document \\
        --train-iters 400 --log-interval 25 --steady-from 250 --windows-table \\
        --log-dir /tmp/layouts --baseline "dMoE DP4" \\
        "dMoE DP4=dmoe_125m_8gpu:4:$D $G" "dMoE EP4=dmoe_125m_8gpu:4:$D $G $E"

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
VOCAB_FILE = REPO_ROOT / "data" / "sample" / "gpt2-vocab.json"
MERGE_FILE = REPO_ROOT / "data" / "sample" / "gpt2-merges.txt"
ITERATION = re.compile(
    r" iteration +(\d+)/ *\d+ \|.*elapsed time per iteration \(ms\): ([0-9.]+) \|"
    r".*lm loss: ([0-9.E+-]+) \|.*tokens per second per GPU: ([0-9]+) \|"
)
IMBALANCE = re.compile(r"expert-parallel load imbalance: ([0-9.]+) \|")
FACTOR_FLAG = "--moe-expert-parallel-buffer-factor"
# The notes moe.training_hooks prints when the expert-parallel blocks shrink ("goes from") or
# grow ("grows from"); the factors are Python floats as printed ("1.5", "2.25").
FACTOR_NOTE = re.compile(
    r"the buffer factor (?:goes|grows) from ([0-9]+(?:\.[0-9]+)?) to ([0-9]+(?:\.[0-9]+)?)"
)


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
    # The EP block factor in effect when the window's line was logged (None: unknown, or the
    # run exchanges exact splits).
    block_factor: Optional[float]


@dataclass
class Result:
    row: Row
    returncode: int
    windows: List[Window] = field(default_factory=list)
    last_line: str = ""
    # The EP block factor in effect as far as the output has been read.
    block_factor: Optional[float] = None


def ensure_data() -> None:
    if not DATA_PREFIX.with_suffix(".idx").is_file():
        print("data/owt missing: running examples/data_preprocessing.sh", flush=True)
        subprocess.run(["bash", str(REPO_ROOT / "examples" / "data_preprocessing.sh")], check=True)


def check_data_path(prefix: Path) -> None:
    """Refuses, in one line, a --data-path prefix whose .idx or .bin is missing."""
    for suffix in (".idx", ".bin"):
        path = Path(f"{prefix}{suffix}")
        if path.is_file():
            continue
        if suffix == ".bin" and Path(f"{prefix}.bin.xz.part0").is_file():
            fix = f"decompress it first: cat {prefix}.bin.xz.part* | xz -dc -T0 > {path}"
        else:
            fix = (
                "pass the prefix of a Megatron indexed dataset (PREFIX.idx and PREFIX.bin, "
                "written by tools/preprocess_data.py)"
            )
        raise SystemExit(f"--data-path {prefix}: {path} not found; {fix}")


def last_flag_value(words: List[str], flag: str) -> Optional[str]:
    """The value of the last `flag VALUE` or `flag=VALUE` in `words` (the one argparse keeps)."""
    value = None
    for index, word in enumerate(words):
        if word == flag and index + 1 < len(words):
            value = words[index + 1]
        elif word.startswith(flag + "="):
            value = word[len(flag) + 1 :]
    return value


def initial_block_factor(row: Row, extra_args: str = "") -> Optional[float]:
    """The EP block factor a row starts with: the last --moe-expert-parallel-buffer-factor of
    its flags and EXTRA_ARGS (examples/common.sh appends those last), else the one value its
    example script sets; None where neither says (or the value is not a number)."""
    value = last_flag_value([*row.flags, *extra_args.split()], FACTOR_FLAG)
    if value is None:
        try:
            script = (REPO_ROOT / "examples" / f"{row.script}.sh").read_text()
        except OSError:
            return None
        values = set(re.findall(rf"{FACTOR_FLAG}[= ]+([0-9.]+)", script))
        value = values.pop() if len(values) == 1 else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def read_line(result: Result, line: str) -> Optional[Window]:
    """Takes one line of a row's output into `result`: a block-factor note changes the factor
    in effect (so the change counts in the window in which it was logged), an iteration line
    adds a window carrying the factor. Returns the window the line added, else None."""
    note = FACTOR_NOTE.search(line)
    if note:
        if result.block_factor is None:
            # No note before this one: the factor it grows or shrinks from held from the start.
            for window in result.windows:
                window.block_factor = float(note.group(1))
        result.block_factor = float(note.group(2))
    window = None
    match = ITERATION.search(line)
    if match:
        imbalance = IMBALANCE.search(line)
        window = Window(
            int(match.group(1)), float(match.group(2)), float(match.group(3)),
            float(match.group(4)), float(imbalance.group(1)) if imbalance else None,
            result.block_factor,
        )  # fmt: skip
        result.windows.append(window)
    if line.strip():
        result.last_line = line.strip()
    return window


def progress_line(label: str, window: Window) -> str:
    """The line printed as each window is read."""
    line = (
        f"   {label} it {window.iteration}: {window.ms:.1f} ms, "
        f"{window.tokens_per_gpu:.0f} tok/s/GPU"
    )
    if window.imbalance is not None:
        line += f", imbalance {window.imbalance:.3f}"
    if window.block_factor is not None:
        line += f", factor {window.block_factor:.2f}"
    return line


def run_row(row: Row, args: argparse.Namespace, log_dir: Path) -> Result:
    name = re.sub(r"[^A-Za-z0-9]+", "_", row.label).strip("_")
    output_dir = Path("/tmp") / f"parallel_layouts_{name}_{os.getpid()}"
    command = [
        "bash", str(REPO_ROOT / "examples" / f"{row.script}.sh"),
        str(args.data_path), str(args.vocab_file), str(args.merge_file), str(output_dir),
        "--save", "", "--load", "", "--eval-iters", "0",
        "--train-iters", str(args.train_iters), "--log-interval", str(args.log_interval),
        *row.flags,
    ]  # fmt: skip
    env = dict(os.environ, NPROC_PER_NODE=str(row.nproc), PYTHONUNBUFFERED="1")
    result = Result(
        row, returncode=-1, block_factor=initial_block_factor(row, env.get("EXTRA_ARGS", ""))
    )
    log_path = log_dir / f"{name}.log"
    started = time.time()
    print(f"== {row.label}: {shlex.join(command)}", flush=True)
    with open(log_path, "w") as log, subprocess.Popen(
        command, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    ) as process:  # fmt: skip
        for line in process.stdout:
            log.write(line)
            window = read_line(result, line)
            if window is not None:
                print(progress_line(row.label, window), flush=True)
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


def factor_summary(windows: List[Window]) -> str:
    """The block factor over `windows`: the last one's, or its range where it changed among
    them; empty where unknown."""
    factors = [w.block_factor for w in windows if w.block_factor is not None]
    if not factors:
        return ""
    low, high = min(factors), max(factors)
    return f"{factors[-1]:.2f}" if low == high else f"{low:.2f}–{high:.2f}"


def windows_table(results: List[Result], steady_from: int, log_interval: int) -> List[str]:
    """A markdown table of every row's steady windows, one line each."""
    lines = [
        "| layout | iteration | ms / iteration | tokens/s per GPU | EP imbalance | block factor |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        for window in steady(result, steady_from, log_interval):
            imbalance = f"{window.imbalance:.3f}" if window.imbalance is not None else ""
            factor = f"{window.block_factor:.2f}" if window.block_factor is not None else ""
            lines.append(
                f"| {result.row.label} | {window.iteration} | {window.ms:.1f} | "
                f"{window.tokens_per_gpu:,.0f} | {imbalance} | {factor} |"
            )
    return lines


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
    parser.add_argument(
        "--data-path", type=Path, default=None,
        help="Megatron indexed-dataset prefix (PREFIX.idx and PREFIX.bin) the rows train on; "
        "default: the bundled sample data/owt/owt_text_document, tokenized first if missing.",
    )  # fmt: skip
    parser.add_argument("--vocab-file", type=Path, default=VOCAB_FILE)
    parser.add_argument("--merge-file", type=Path, default=MERGE_FILE)
    parser.add_argument(
        "--windows-table", action="store_true",
        help="After the summary, a table of every steady window (EP imbalance, block factor).",
    )  # fmt: skip
    args = parser.parse_args(argv)
    rows = [Row.parse(text) for text in args.rows]
    # The scripts run from the repository root; relative paths are the caller's.
    if args.data_path is None:
        ensure_data()
        args.data_path = DATA_PREFIX
    else:
        args.data_path = args.data_path.absolute()
        check_data_path(args.data_path)
    args.vocab_file = args.vocab_file.absolute()
    args.merge_file = args.merge_file.absolute()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    results = [run_row(row, args, args.log_dir) for row in rows]
    baseline = next((r for r in results if r.row.label == args.baseline), None)
    base_tokens = (
        mean([w.tokens_per_gpu for w in steady(baseline, args.steady_from, args.log_interval)])
        if baseline
        else None
    )

    print()
    print(
        f"data {args.data_path}; windows from iteration {args.steady_from}; logs in {args.log_dir}"
    )
    header = "| layout | GPUs | windows | ms / iteration | tokens/s per GPU | × baseline | EP imbalance | block factor | lm loss (last) |"
    print(header)
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
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
            f"{factor_summary(windows)} | {result.windows[-1].lm_loss:.4f} |"
        )
    if args.windows_table:
        print()
        print("\n".join(windows_table(results, args.steady_from, args.log_interval)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
