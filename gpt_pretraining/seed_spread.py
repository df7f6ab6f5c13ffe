"""The spread over seeds for tools/time_to_quality.py: runs given the same --labels name are one
recipe's seeds, and a second table gives each recipe's mean and range.

Each recipe's runs are set against each run of the first recipe (the reference, usually the dense
model's seeds), the target being that reference run's own final validation loss, so that every
pair is a one-run comparison as the per-run table makes: the reference run reaches its target at
its last evaluation, the other at its first crossing. A recipe's speed-ups are the mean over its
pairs with the range beside it ("1.62x (1.55x-1.70x)"), so the seeds of both recipes show in the
spread; a pair whose run never reaches the reference run's final loss is counted apart ("2 of 4
not reached"). Its final validation loss and tokens/s are the mean over its runs, with the
range.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence

from gpt_pretraining.time_to_quality import (
    NOT_REACHED,
    RunMeasures,
    first_crossing,
    format_count,
)

SEEDS_COLUMNS = (
    "recipe", "runs", "final validation loss", "tokens/s", "speed-up (tokens)", "speed-up (time)",
)  # fmt: skip


def label_groups(labels: Sequence[str]) -> Dict[str, List[int]]:
    """The run indices of each label, in the order the labels first appear."""
    groups: Dict[str, List[int]] = {}
    for index, label in enumerate(labels):
        groups.setdefault(label, []).append(index)
    return groups


def has_seeds(labels: Sequence[str]) -> bool:
    """Whether some label names more than one run."""
    return len(set(labels)) < len(labels)


def _mean_and_range(values: Sequence[float], cell: Callable[[float], str]) -> str:
    mean = cell(sum(values) / len(values))
    if len(values) == 1:
        return mean
    return f"{mean} ({cell(min(values))}-{cell(max(values))})"


def seeds_table(measures: Sequence[RunMeasures]) -> str:
    """One row per recipe (module docstring); the first recipe is the reference."""
    groups = label_groups([measure.label for measure in measures])
    references = [measures[index] for index in next(iter(groups.values()))]
    rows = ["| " + " | ".join(SEEDS_COLUMNS) + " |", "|" + "---|" * len(SEEDS_COLUMNS)]
    for label, indices in groups.items():
        runs = [measures[index] for index in indices]
        token_ratios: List[float] = []
        time_ratios: List[float] = []
        for reference in references:
            target = reference.final_validation_loss
            reached = first_crossing(reference.curve, target)
            for run in runs:
                crossing = first_crossing(run.curve, target)
                if crossing is not None and reached is not None:
                    token_ratios.append(reached.tokens / crossing.tokens)
                    time_ratios.append(reached.seconds / crossing.seconds)
        pairs = len(references) * len(runs)
        cells = [
            label,
            str(len(runs)),
            _mean_and_range([run.final_validation_loss for run in runs], "{:.4f}".format),
            _mean_and_range([run.tokens_per_second for run in runs], format_count),
        ]
        for ratios in (token_ratios, time_ratios):
            if not ratios:
                cells.append(NOT_REACHED)
                continue
            cell = _mean_and_range(ratios, "{:.2f}x".format)
            if len(ratios) < pairs:
                cell += f", {pairs - len(ratios)} of {pairs} {NOT_REACHED}"
            cells.append(cell)
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


__all__ = ["SEEDS_COLUMNS", "has_seeds", "label_groups", "seeds_table"]
