"""Throughput of tools/preprocess_data.py: docs/s, MB/s, tokens/s, CPU cores kept busy and peak
memory, optionally against upstream Megatron-LM's own script (`--upstream-megatron`) or another
checkout of this project (`--baseline`) on the same input and worker count; or, with
`--long-document-mb N`, one N MB JSON line through this project's tool alone.

    python -m bench.preprocess --input data/sample/openwebtext-1000.jsonl --workers 2 \\
        --upstream-megatron /path/to/megatron-lm-checkout

Each tool runs `--repeats` times as a subprocess (the whole command is timed, interpreter start,
tokenizer load and pool start included); the table shows the median wall time and the largest
peak memory seen. Peak memory is the sum of RSS over the process and all its children, polled
every 20 ms, so pages a forked worker shares with its parent are counted once per process.
Tokens are read back from the written .idx; MB/s is uncompressed input bytes / 2**20 per
second, the MB of Megatron's own progress lines.

Upstream checkout (kept outside this repository, never committed): a directory holding
Megatron-LM's `tools/preprocess_data.py` at its own relative path, plus the modules that script
imports at their own paths. For a revision whose imports are `megatron.tokenizer` and
`megatron.data.indexed_dataset`, that is `megatron/tokenizer/{__init__,tokenizer,gpt2_tokenization,
bert_tokenization}.py` and `megatron/data/indexed_dataset.py`, with `megatron/__init__.py` and
`megatron/data/__init__.py` reduced to empty package markers if the originals pull in training
code. Upstream's GPT2BPETokenizer is the pure-Python `gpt2_tokenization.py`; measure that, not a
faster substitute. For the MegaBlocks fork (stanford-futuredata/Megatron-LM, whose script requires
--chunk-size), `megatron/__init__.py` reduced to a `print_rank_0` that prints, and its
indexed_dataset's two `np.float` (removed in NumPy 1.24) written as the `float` they aliased. The script also needs `nltk` importable. Older upstream scripts read plain
.jsonl only, so a compressed --input is decompressed once into the output directory and that
copy is fed to both tools. The benchmark then checks that both wrote identical .bin/.idx bytes.
"""

from __future__ import annotations

import argparse
import gzip
import json
import lzma
import os
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import List

import numpy as np

try:
    import psutil
except ImportError:  # pragma: no cover - depends on the environment
    sys.exit("bench/preprocess.py needs psutil to measure peak memory: pip install psutil")

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
DEFAULT_INPUT = os.path.join(REPO_ROOT, "data", "sample", "openwebtext-1000.jsonl.xz")
DEFAULT_VOCAB = os.path.join(REPO_ROOT, "data", "sample", "gpt2-vocab.json")
DEFAULT_MERGES = os.path.join(REPO_ROOT, "data", "sample", "gpt2-merges.txt")
INDEX_MAGIC = b"MMIDIDX\x00\x00"
POLL_SECONDS = 0.02


@dataclass
class RunResult:
    """One timed run of a preprocessing command."""

    wall_seconds: float
    peak_rss_bytes: int
    output_prefix: str
    cpu_seconds: float = 0.0  # user + system of the process and every child it waited for


@dataclass
class IndexSummary:
    """What the benchmark needs from a Megatron mmap .idx file."""

    dtype_code: int
    sequences: int
    documents: int
    tokens: int


@dataclass
class ToolSummary:
    """Median-of-repeats figures for one tool."""

    name: str
    runs: List[RunResult]
    index: IndexSummary

    @property
    def wall_seconds(self) -> float:
        return statistics.median(run.wall_seconds for run in self.runs)

    @property
    def cores_busy(self) -> float:
        """CPU seconds per wall second, median over the runs."""
        return statistics.median(run.cpu_seconds / run.wall_seconds for run in self.runs)

    @property
    def peak_rss_mib(self) -> float:
        return max(run.peak_rss_bytes for run in self.runs) / 2**20

    @property
    def output_prefix(self) -> str:
        return self.runs[-1].output_prefix


def read_index_summary(idx_path: str) -> IndexSummary:
    """Header and token count of an mmap .idx (magic, <Q version, <B dtype, <Q seqs, <Q docs, sizes)."""
    with open(idx_path, "rb") as stream:
        magic = stream.read(len(INDEX_MAGIC))
        if magic != INDEX_MAGIC:
            raise ValueError(f"{idx_path}: not a Megatron mmap index (magic {magic!r})")
        (version,) = struct.unpack("<Q", stream.read(8))
        if version != 1:
            raise ValueError(f"{idx_path}: index version {version}, expected 1")
        (dtype_code,) = struct.unpack("<B", stream.read(1))
        sequences, doc_idx_entries = struct.unpack("<QQ", stream.read(16))
        sizes = np.frombuffer(stream.read(4 * sequences), dtype=np.int32)
    return IndexSummary(dtype_code, sequences, doc_idx_entries - 1, int(sizes.sum(dtype=np.int64)))


def uncompressed_input(path: str, scratch_dir: str) -> str:
    """`path` itself if plain text, else a decompressed copy in `scratch_dir`."""
    openers = {".xz": lzma.open, ".gz": gzip.open}
    opener = openers.get(os.path.splitext(path)[1])
    if opener is None:
        return path
    plain_path = os.path.join(scratch_dir, os.path.basename(os.path.splitext(path)[0]))
    with opener(path, "rb") as source, open(plain_path, "wb") as target:
        shutil.copyfileobj(source, target)
    return plain_path


def tree_rss_bytes(process: psutil.Process) -> int:
    """RSS of a process plus all its descendants; processes that exit mid-poll count as 0."""
    total = 0
    try:
        members = [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    for member in members:
        try:
            total += member.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def timed_run(command: List[str], env: dict, log_path: str, output_prefix: str) -> RunResult:
    """Run `command`, polling the process tree's RSS; raise with the log tail if it fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log_path, "wb") as log:
        start = time.perf_counter()
        child = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        watched = psutil.Process(child.pid)
        peak = 0
        while child.poll() is None:
            peak = max(peak, tree_rss_bytes(watched))
            time.sleep(POLL_SECONDS)
        wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if child.returncode != 0:
        with open(log_path, errors="replace") as log:
            tail = log.read()[-3000:]
        raise RuntimeError(f"exit code {child.returncode} from {' '.join(command)}\n{tail}")
    return RunResult(wall, peak, output_prefix, cpu)


@dataclass
class Tool:
    """A preprocessing script to benchmark and the PYTHONPATH entry its imports need."""

    name: str
    script: str
    pythonpath: str | None = None
    extra_args: tuple = ()

    def command(self, args: argparse.Namespace, input_path: str, prefix: str) -> List[str]:
        """Megatron's preprocess_data.py command line, identical for every tool but for
        `extra_args` (upstream's --chunk-size)."""
        return [
            sys.executable, self.script, "--input", input_path, "--output-prefix", prefix,
            *_tokenizer_flags(args), "--append-eod", "--workers", str(args.workers),
            *self.extra_args,
        ]  # fmt: skip

    def environment(self) -> dict:
        """This process's environment with `pythonpath` prepended to PYTHONPATH."""
        env = dict(os.environ)
        if self.pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [self.pythonpath, env.get("PYTHONPATH")])
            )
        return env


def _tokenizer_flags(args: argparse.Namespace) -> List[str]:
    if args.tokenizer_type == "GPT2BPETokenizer":
        files = ["--vocab-file", args.vocab_file, "--merge-file", args.merge_file]
    else:
        files = ["--tokenizer-model", args.tokenizer_model]
    return ["--tokenizer-type", args.tokenizer_type, *files]


def benchmark_tools(
    tools: List[Tool], args: argparse.Namespace, input_path: str
) -> List[ToolSummary]:
    """Run every tool `args.repeats` times, alternating tools so load drift hits each alike."""
    runs: dict = {tool.name: [] for tool in tools}
    for repeat in range(args.repeats):
        for number, tool in enumerate(tools):
            prefix = os.path.join(args.output_dir, f"tool{number}-run{repeat}")
            run = timed_run(
                tool.command(args, input_path, prefix), tool.environment(), f"{prefix}.log", prefix
            )
            runs[tool.name].append(run)
            print(
                f"  {tool.name} run {repeat + 1}/{args.repeats}: {run.wall_seconds:.2f} s",
                file=sys.stderr,
            )
    return [
        ToolSummary(
            tool.name,
            runs[tool.name],
            read_index_summary(f"{runs[tool.name][-1].output_prefix}_text_document.idx"),
        )
        for tool in tools
    ]


def first_difference(path_a: str, path_b: str) -> int | None:
    """Byte offset of the first difference (the shorter length if one is a prefix), or None."""
    with open(path_a, "rb") as file_a, open(path_b, "rb") as file_b:
        a, b = file_a.read(), file_b.read()
    if a == b:
        return None
    common = min(len(a), len(b))
    mismatch = np.flatnonzero(
        np.frombuffer(a, np.uint8, common) != np.frombuffer(b, np.uint8, common)
    )
    return int(mismatch[0]) if mismatch.size else common


def compare_outputs(ours: ToolSummary, upstream: ToolSummary) -> List[str]:
    """Lines saying whether both tools wrote the same bytes, and where they first differ."""
    lines = []
    for suffix in (".bin", ".idx"):
        path_ours = f"{ours.output_prefix}_text_document{suffix}"
        path_upstream = f"{upstream.output_prefix}_text_document{suffix}"
        offset = first_difference(path_ours, path_upstream)
        sizes = f"{os.path.getsize(path_ours)} vs {os.path.getsize(path_upstream)} bytes"
        if offset is None:
            lines.append(f"{suffix}: byte-identical ({os.path.getsize(path_ours)} bytes)")
        elif suffix == ".bin":
            token = offset // 2 if ours.index.dtype_code == 8 else None
            where = f"token {token}" if token is not None else f"byte {offset}"
            lines.append(f"{suffix}: DIFFERENT, first at byte {offset} ({where}); {sizes}")
        else:
            lines.append(f"{suffix}: DIFFERENT, first at byte {offset}; {sizes}")
    return lines


def format_table(summaries: List[ToolSummary], workers: int, input_bytes: int) -> str:
    """Markdown table of median wall time, rates and peak RSS per tool."""
    rows = [
        "| tool | workers | wall s | docs/s | MB/s | tokens/s | CPU cores busy | peak RSS MiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for summary in summaries:
        wall = summary.wall_seconds
        rows.append(
            f"| {summary.name} | {workers} | {wall:.2f} | {summary.index.documents / wall:,.0f} "
            f"| {input_bytes / wall / 2**20:.2f} | {summary.index.tokens / wall:,.0f} "
            f"| {summary.cores_busy:.2f} | {summary.peak_rss_mib:,.0f} |"
        )
    return "\n".join(rows)


def long_document(args: argparse.Namespace, input_path: str) -> int:
    """One JSON line of `--long-document-mb` MB (the input's texts joined by blank lines,
    repeated): this project's tool alone, its peak memory, and its tokens against one unsplit
    encode of the whole text."""
    with open(input_path, "rb") as handle:
        texts = [json.loads(line)["text"] for line in handle if line.strip()]
    target = args.long_document_mb * 2**20
    parts, size = [], 0
    while size < target:
        for text in texts:
            parts.append(text)
            size += len(text.encode("utf-8")) + 2
            if size >= target:
                break
    text = "\n\n".join(parts)
    del parts
    line_path = os.path.join(args.output_dir, f"long-document-{args.long_document_mb}mb.jsonl")
    with open(line_path, "w", encoding="utf-8") as handle:
        handle.write(json.dumps({"text": text}) + "\n")
    prefix = os.path.join(args.output_dir, "long")
    tool = Tool("ours", os.path.join(REPO_ROOT, "tools", "preprocess_data.py"), REPO_ROOT)
    run = timed_run(
        tool.command(args, line_path, prefix), tool.environment(), prefix + ".log", prefix
    )
    written = np.fromfile(f"{prefix}_text_document.bin", dtype=np.uint16)
    from megatron.tokenizer import GPT2BPETokenizer

    tokenizer = GPT2BPETokenizer(args.vocab_file, args.merge_file)
    expected = np.asarray(tokenizer.tokenize(text) + [tokenizer.eod], dtype=np.uint16)
    same = np.array_equal(written, expected)
    print(
        f"\nOne JSON line of {os.path.getsize(line_path) / 2**20:.1f} MB, {len(text):,} characters: "
        f"{run.wall_seconds:.2f} s, {written.size:,} tokens, peak RSS {run.peak_rss_bytes / 2**20:,.0f} MiB "
        f"(all processes); tokens {'equal' if same else 'DIFFERENT from'} one unsplit "
        f"{tokenizer.engine} encode of the whole text"
    )
    return 0 if same else 1


def parse_args(argv: List[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument(
        "--input", default=DEFAULT_INPUT, help="JSON-lines corpus (.jsonl, .xz, .gz)"
    )
    parser.add_argument("--workers", type=int, default=2, help="--workers passed to every tool")
    parser.add_argument("--repeats", type=int, default=3, help="runs per tool; the median is shown")
    parser.add_argument(
        "--upstream-megatron", help="directory with upstream Megatron-LM's tools/preprocess_data.py"
    )
    parser.add_argument(
        "--output-dir", help="where outputs and logs go (a temporary dir by default)"
    )
    parser.add_argument(
        "--upstream-chunk-size",
        type=int,
        default=25,
        help="upstream's --chunk-size (documents per Pool.imap task; the MegaBlocks fork requires "
        "the flag, 25 is Megatron-LM's later default and the fork's own example)",
    )
    parser.add_argument(
        "--baseline",
        help="another checkout of this project to run beside this one (e.g. the commit before a change)",
    )
    parser.add_argument(
        "--tokenizer-type",
        default="GPT2BPETokenizer",
        choices=["GPT2BPETokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer"],
    )
    parser.add_argument("--tokenizer-model", help="SentencePiece .model or tokenizer.json")
    parser.add_argument(
        "--long-document-mb",
        type=int,
        default=0,
        help="instead: one JSON line of this many MB through this project's tool alone",
    )
    parser.add_argument("--vocab-file", default=DEFAULT_VOCAB, help="GPT-2 vocab.json")
    parser.add_argument("--merge-file", default=DEFAULT_MERGES, help="GPT-2 merges.txt")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.workers < 1:
        parser.error(f"--repeats and --workers must be >= 1, got {args.repeats}, {args.workers}")
    if args.tokenizer_type != "GPT2BPETokenizer" and not args.tokenizer_model:
        parser.error(f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model")
    if args.upstream_megatron and args.tokenizer_type != "GPT2BPETokenizer":
        parser.error("--upstream-megatron compares GPT2BPETokenizer only")
    if args.upstream_megatron:
        script = os.path.join(args.upstream_megatron, "tools", "preprocess_data.py")
        if not os.path.isfile(script):
            parser.error(f"--upstream-megatron {args.upstream_megatron}: no {script}")
    return args


def main(argv: List[str] | None = None) -> int:
    args = parse_args(argv)
    owns_output_dir = args.output_dir is None
    args.output_dir = args.output_dir or tempfile.mkdtemp(prefix="bench-preprocess-")
    os.makedirs(args.output_dir, exist_ok=True)
    try:
        # One plain-text input for everyone keeps the comparison fair (older upstream reads no .xz).
        input_path = uncompressed_input(args.input, args.output_dir)
        if args.long_document_mb:
            return long_document(args, input_path)
        input_bytes = os.path.getsize(input_path)
        print(
            f"input {input_path}: {input_bytes:,} bytes; outputs in {args.output_dir}",
            file=sys.stderr,
        )
        # Each checkout's tool with that checkout's package first on PYTHONPATH (installed or not).
        tools = [Tool("ours", os.path.join(REPO_ROOT, "tools", "preprocess_data.py"), REPO_ROOT)]
        if args.baseline:
            baseline = os.path.abspath(args.baseline)
            script = os.path.join(baseline, "tools", "preprocess_data.py")
            tools.append(Tool(f"ours at {args.baseline}", script, baseline))
        if args.upstream_megatron:
            upstream_dir = os.path.abspath(args.upstream_megatron)
            script = os.path.join(upstream_dir, "tools", "preprocess_data.py")
            extra = ("--chunk-size", str(args.upstream_chunk_size))
            tools.append(Tool("upstream Megatron-LM", script, upstream_dir, extra))
        load_before = os.getloadavg()[0]
        summaries = benchmark_tools(tools, args, input_path)
        load_after = os.getloadavg()[0]

        print(f"\nInput: {args.input} ({input_bytes / 2**20:.2f} MB uncompressed, "
              f"{summaries[0].index.documents} docs); median of {args.repeats} runs; "
              f"{os.cpu_count()} CPUs; Python {sys.version.split()[0]}; "
              f"1-min load average {load_before:.2f} before, {load_after:.2f} after\n")  # fmt: skip
        print(format_table(summaries, args.workers, input_bytes))
        ours = summaries[0]
        for other in summaries[1:]:
            speedup = (ours.index.tokens / ours.wall_seconds) / (
                other.index.tokens / other.wall_seconds
            )
            print(f"\nSpeedup (ours / {other.name}, tokens/s): {speedup:.2f}x")
            if ours.index.tokens != other.index.tokens:
                print(
                    f"Token counts differ: ours {ours.index.tokens:,}, {other.name} {other.index.tokens:,}"
                )
            for line in compare_outputs(ours, other):
                print(line)
    finally:
        if owns_output_dir:
            shutil.rmtree(args.output_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
