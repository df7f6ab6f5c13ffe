"""Estimate a pretrain_gpt.py run's peak GPU memory per rank, without a GPU or data.

    python tools/estimate_memory.py --world-size 8 --gpu-memory-gib 80 \\
        --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 \\
        --max-position-embeddings 1024 --micro-batch-size 32 --global-batch-size 512 \\
        --lr 6e-4 --train-iters 1000 --bf16 --moe-num-experts 64 --moe-top-k 1

Takes pretrain_gpt.py's flags (MoE flags included) plus `--world-size` (default 1) and
`--gpu-memory-gib` (default 80; `auto`: this machine's first GPU, or 80 without one); prints the
start-up line pretrain_gpt.py prints, a table of the parts (megatron.memory_plan), and when the
run does not fit, the flags that would make it fit.

With `--choose FLAGS` (repeated, fastest first) it picks instead: it prints on stdout the first
FLAGS whose run fits the GPU (or the last, with a warning, when none does) and on stderr one
line saying what it chose and why. Flags after a final `--then` are applied after the choice
(a user's own flags, which override it). The example scripts choose their memory settings this way
(examples/common.sh).
The data files are never read: without a data source the tool passes a placeholder
--data-path, and without --vocab-file/--merge-file the bundled GPT-2 vocabulary (only its size
matters); it says so. Bad flags: one `error:` line, exit 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from gpt_pretraining import GPT_RUN  # noqa: E402
from megatron.composition.run import tokenizer_and_padded_vocab  # noqa: E402
from megatron.config import Config, ConfigError  # noqa: E402
from megatron.memory_plan import (  # noqa: E402
    GIB,
    MemoryEstimate,
    estimate_memory,
    format_estimate_line,
    format_warning,
    suggest_fits,
)

SAMPLE_VOCAB = REPO_ROOT / "data" / "sample" / "gpt2-vocab.json"
SAMPLE_MERGES = REPO_ROOT / "data" / "sample" / "gpt2-merges.txt"
PLACEHOLDER_DATA = "estimate-memory-placeholder"


def _tool_flags(argv: Sequence[str]) -> Tuple[argparse.Namespace, List[str]]:
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--gpu-memory-gib", default="80")
    parser.add_argument("--choose", action="append", default=None)
    argv = list(argv)
    then: List[str] = []
    if "--then" in argv:  # everything after it, verbatim (empty values included)
        then = argv[argv.index("--then") + 1 :]
        argv = argv[: argv.index("--then")]
    try:
        tool, rest = parser.parse_known_args(argv)
    except argparse.ArgumentError as error:
        raise ConfigError(str(error)) from None
    tool.then = then
    tool.gpu_memory_gib = _gpu_memory_gib(tool.gpu_memory_gib)
    if tool.world_size < 1 or tool.gpu_memory_gib <= 0:
        raise ConfigError(
            f"--world-size {tool.world_size} and --gpu-memory-gib {tool.gpu_memory_gib} must "
            "be positive"
        )
    return tool, rest


def _gpu_memory_gib(value: str) -> float:
    """`--gpu-memory-gib`: a number, or `auto` for this machine's first GPU (80 without one)."""
    if value == "auto":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / GIB
        return 80.0
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"--gpu-memory-gib {value!r} is not a number or 'auto'") from None


def choose(
    candidates: Sequence[str],
    rest: Sequence[str],
    world_size: int,
    device_memory: int,
    then: Sequence[str] = (),
) -> Tuple[str, str]:
    """(the first of `candidates` whose run fits `device_memory`, or the last; the reason).
    Each run is `rest`, then the candidate, then `then` (the user's own flags, which win)."""
    too_large = []
    for index, flags in enumerate(candidates):
        config, _ = build_config([*rest, *flags.split(), *then], world_size)
        estimate = estimate_memory(config, GPT_RUN.mlp_spec(config), device_memory)
        label = flags or "the script's defaults"
        if then:
            label += f", then your own flags ({' '.join(then)})"
        needs = f"{estimate.total / GIB:.1f} GiB of {device_memory / GIB:.1f} GiB"
        if estimate.fits is not False or index == len(candidates) - 1:
            reason = f"memory settings: {label} (estimated {needs}"
            if too_large:
                reason += "; faster settings that do not fit: " + "; ".join(too_large)
            reason += ")"
            if estimate.fits is False:
                reason = "WARNING: no choice of this script fits this GPU; " + reason
            return flags, reason
        too_large.append(f"{label} needs {estimate.total / GIB:.1f} GiB")
    raise ConfigError("--choose needs at least one candidate")


def _with_placeholders(argv: List[str]) -> Tuple[List[str], List[str]]:
    """`argv` with the data and vocabulary flags filled in where absent, and notes saying so."""
    notes, argv = [], list(argv)
    data_flags = ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path")
    if not any(flag in argv for flag in data_flags):
        argv += ["--data-path", PLACEHOLDER_DATA]
        notes.append("no --data-path: a placeholder is used (the estimate reads no data)")
    tokenizer = "GPT2BPETokenizer"
    if "--tokenizer-type" in argv:
        tokenizer = argv[argv.index("--tokenizer-type") + 1]
    if tokenizer == "GPT2BPETokenizer":
        for flag, path in (("--vocab-file", SAMPLE_VOCAB), ("--merge-file", SAMPLE_MERGES)):
            if flag not in argv:
                argv += [flag, str(path)]
                notes.append(f"no {flag}: the bundled GPT-2 file {path.name} gives the vocab size")
    return argv, notes


def build_config(argv: Sequence[str], world_size: int) -> Tuple[Config, List[str]]:
    """The Config pretrain_gpt.py would build for `argv` on `world_size` ranks, and notes."""
    argv, notes = _with_placeholders(list(argv))
    args, config_notes = GPT_RUN.resolve(argv, world_size)
    try:
        _, padded = tokenizer_and_padded_vocab(args)
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read the tokenizer for the vocabulary size: {error}") from None
    config = GPT_RUN.config(args, config_notes, padded)
    return config, notes


def breakdown_table(estimate: MemoryEstimate) -> str:
    """Each part in GiB, the peak, the allocator's reserve and the worst MoE routing case."""
    rows = [(name.replace("_", " "), value) for name, value in estimate.parts().items()]
    rows += [
        ("peak allocated", estimate.allocated),
        ("allocator overhead", estimate.allocator_overhead),
        ("total (reserved)", estimate.total),
        ("total, worst routing", estimate.worst_case_total),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{'part'.ljust(width)}  GiB", f"{'-' * width}  ------"]
    lines += [f"{name.ljust(width)}  {value / GIB:6.2f}" for name, value in rows]
    lines.append(f"(pipeline stage {estimate.pipeline_rank} has the largest peak)")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print the estimate (or the choice, with --choose); 0, or 1 with one `error:` line for
    bad flags."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        tool, rest = _tool_flags(argv)
        device_memory = int(tool.gpu_memory_gib * GIB)
        if tool.choose:
            flags, reason = choose(tool.choose, rest, tool.world_size, device_memory, tool.then)
            print(reason, file=sys.stderr)
            print(flags)
            return 0
        config, notes = build_config(rest, tool.world_size)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for note in notes:
        print(f"note: {note}")
    estimate = estimate_memory(config, GPT_RUN.mlp_spec(config), device_memory)
    print(format_estimate_line(estimate))
    print(breakdown_table(estimate))
    if estimate.fits is False:
        print(format_warning(estimate, suggest_fits(config, GPT_RUN.mlp_spec, device_memory)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
