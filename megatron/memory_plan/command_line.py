"""Estimate a pretrain_gpt.py run's peak GPU memory per rank, without a GPU or data.

The memory planner's command line, tools/estimate_memory.py, for the run composition it is given
(`main(run)`; the tool passes gpt_pretraining.GPT_RUN, so that the estimate and training build
the same Config from the same flags): the run's flags plus `--world-size` and
`--gpu-memory-gib` in; the start-up line, a table of the parts and, when the run does not fit,
the flags that would make it fit out. `choose` picks the first of several flag sets that fits
(`--choose`, as examples/common.sh asks). The data files are never read: without a data source a
placeholder --data-path stands in, and without --vocab-file/--merge-file the checkout's bundled
GPT-2 vocabulary (data/sample; only its size matters); the other tokenizer types read their
--tokenizer-model for it, and NullTokenizer nothing (--vocab-size is its size). The learning rate
and the run's length do not change a step's memory: without --lr, --train-iters or
--train-samples, values that pass the run's validation stand in (`_with_schedule_placeholders`),
and the training run still asks for them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from megatron.arguments.argument_files import ArgumentFileParser
from megatron.composition.run import RunComposition, tokenizer_and_padded_vocab
from megatron.config import Config, ConfigError
from megatron.memory_plan import (
    GIB,
    MemoryEstimate,
    estimate_memory,
    format_estimate_line,
    format_warning,
    suggest_fits,
)

# The checkout this package is installed from in place (pip install -e .): its bundled sample.
REPO_ROOT = Path(__file__).resolve().parents[2]

SAMPLE_VOCAB = REPO_ROOT / "data" / "sample" / "gpt2-vocab.json"
SAMPLE_MERGES = REPO_ROOT / "data" / "sample" / "gpt2-merges.txt"
PLACEHOLDER_DATA = "estimate-memory-placeholder"
# Longer than any warmup or decay a command sets, so that the schedule's checks pass.
PLACEHOLDER_TRAIN_LENGTH = 10**12


def _tool_flags(argv: Sequence[str]) -> Tuple[argparse.Namespace, List[str]]:
    # Expands @FILE, so that the placeholders below see the flags written in one.
    parser = ArgumentFileParser(add_help=False, exit_on_error=False)
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
    run: RunComposition,
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
        config, _ = build_config(run, [*rest, *flags.split(), *then], world_size)
        estimate = estimate_memory(config, run.mlp_spec(config), device_memory)
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
    # --mock-data is a data source too: a placeholder path beside it would be refused.
    data_flags = (
        "--data-path", "--train-data-path", "--valid-data-path", "--test-data-path", "--mock-data"
    )  # fmt: skip
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


def _with_schedule_placeholders(args: argparse.Namespace) -> List[str]:
    """Fill in --lr and the run's length where `args` has none (the smallest learning rate that
    passes, --min-lr; a length in the unit of the schedule's flags), and notes saying so."""
    missing = []
    if args.lr is None:
        args.lr = args.min_lr
        missing.append("--lr")
    if args.train_iters is None and args.train_samples is None:
        in_samples = any(
            getattr(args, name, None)
            for name in vars(args)
            if name.startswith("lr_") and name.endswith("_samples")
        )
        unit = "samples" if in_samples else "iters"
        setattr(args, f"train_{unit}", PLACEHOLDER_TRAIN_LENGTH)
        missing.append(f"--train-{unit}")
    if not missing:
        return []
    return [
        f"no {' or '.join(missing)}: placeholders stand in (a step's memory does not depend on them)"
    ]


def build_config(
    run: RunComposition, argv: Sequence[str], world_size: int
) -> Tuple[Config, List[str]]:
    """The Config `run` builds for `argv` on `world_size` ranks (with GPT_RUN, the one
    pretrain_gpt.py builds), and notes."""
    argv, notes = _with_placeholders(list(argv))
    parsed = run.parse_arguments(argv)
    notes += _with_schedule_placeholders(parsed)
    args, config_notes = run.resolve_parsed(parsed, world_size)
    try:
        _, padded = tokenizer_and_padded_vocab(args)
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read the tokenizer for the vocabulary size: {error}") from None
    config = run.config(args, config_notes, padded)
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


def main(run: RunComposition, argv: Optional[Sequence[str]] = None) -> int:
    """tools/estimate_memory.py for `run`: print the estimate (or the choice, with --choose);
    0, or 1 with one `error:` line for bad flags."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        tool, rest = _tool_flags(argv)
        device_memory = int(tool.gpu_memory_gib * GIB)
        if tool.choose:
            flags, reason = choose(
                run, tool.choose, rest, tool.world_size, device_memory, tool.then
            )
            print(reason, file=sys.stderr)
            print(flags)
            return 0
        config, notes = build_config(run, rest, tool.world_size)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for note in notes:
        print(f"note: {note}")
    estimate = estimate_memory(config, run.mlp_spec(config), device_memory)
    print(format_estimate_line(estimate))
    print(breakdown_table(estimate))
    if estimate.fits is False:
        print(format_warning(estimate, suggest_fits(config, run.mlp_spec, device_memory)))
    return 0
