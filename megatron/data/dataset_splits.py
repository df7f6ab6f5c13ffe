"""Megatron's `--split`, `--data-path` and sample-count arithmetic, as plain functions."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

# Megatron over-asks each blended dataset by 0.5% so greedy blending never runs one dry.
BLEND_OVERSAMPLE = 1.005


def split_note(split: str) -> Optional[str]:
    """A note on how a `--split` of two weights is read (the test split gets none), or None;
    ValueError for a --split that cannot be read (parse_split_string)."""
    fractions = parse_split_string(split)
    if len(str(split).replace("/", ",").split(",")) != 2:  # "1" alone: all for training
        return None
    train, valid, test = (f"{100 * fraction:.1f}%" for fraction in fractions)
    return (
        f"--split {split} has 2 weights, read as train, validation (test gets none): train "
        f"{train}, validation {valid}, test {test}; give three weights, e.g. 949,50,1, to say so"
    )


def parse_split_string(split: str) -> List[float]:
    """Normalized train/valid/test fractions from `--split` ("949,50,1", "98/2/0", or "1")."""
    text = str(split).strip()
    separator = "," if "," in text else "/"
    parts = text.split(separator)
    if len(parts) > 3:
        raise ValueError(
            f"--split {split!r} has {len(parts)} values; give at most 3 (train, valid, test), "
            "e.g. '949,50,1'"
        )
    values = []
    for part in parts:
        try:
            value = float(part)
        except ValueError:
            raise ValueError(
                f"--split {split!r}: {part.strip()!r} is not a number; use comma- or "
                "slash-separated weights such as '949,50,1' or '98/2/0'"
            ) from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"--split {split!r}: weight {part.strip()!r} must be finite and >= 0")
        values.append(value)
    values += [0.0] * (3 - len(values))
    total = sum(values)
    if total <= 0:
        raise ValueError(f"--split {split!r}: the weights sum to 0; at least one must be positive")
    return [value / total for value in values]


def get_train_valid_test_split(split: str, num_documents: int) -> List[int]:
    """Document boundaries [0, train_end, valid_end, num_documents] for `--split`.

    Each boundary adds `int(round(fraction * num_documents))` (Python's half-to-even round);
    any rounding surplus is then subtracted from every boundary after the first, as Megatron's
    `get_train_valid_test_split_` does.
    """
    if num_documents < 0:
        raise ValueError(f"num_documents must be >= 0, got {num_documents}")
    fractions = parse_split_string(split)
    boundaries = [0]
    for fraction in fractions:
        boundaries.append(boundaries[-1] + int(round(fraction * float(num_documents))))
    surplus = boundaries[-1] - num_documents
    for index in range(1, len(boundaries)):
        boundaries[index] -= surplus
    return boundaries


@dataclass(frozen=True)
class DataBlend:
    """Dataset prefixes and their normalized weights (None for a single, unweighted prefix)."""

    prefixes: List[str]
    weights: List[float] | None

    @property
    def is_blended(self) -> bool:
        return self.weights is not None


def parse_data_path(data_path: Sequence[str], flag: str = "--data-path") -> DataBlend:
    """Parse `PREFIX` or `W1 PREFIX1 W2 PREFIX2 ...` into prefixes and normalized weights.

    As in Megatron, any list longer than one entry is a weighted blend, even `1.0 PREFIX`.
    """
    items = [str(item) for item in data_path]
    if not items:
        raise ValueError(f"{flag} is empty; give a dataset prefix or 'WEIGHT PREFIX' pairs")
    if len(items) == 1:
        return DataBlend([items[0].strip()], None)
    if len(items) % 2 != 0:
        raise ValueError(
            f"{flag} {' '.join(items)!r} has {len(items)} entries; a blend needs "
            "'WEIGHT PREFIX' pairs (an even count), a single dataset one PREFIX"
        )
    weights, prefixes = [], []
    for weight_text, prefix in zip(items[0::2], items[1::2]):
        try:
            weight = float(weight_text)
        except ValueError:
            raise ValueError(
                f"{flag}: {weight_text!r} (before prefix {prefix!r}) is not a weight; a blend "
                "is written 'WEIGHT PREFIX WEIGHT PREFIX ...'"
            ) from None
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(
                f"{flag}: weight {weight_text!r} of {prefix!r} must be finite and >= 0"
            )
        weights.append(weight)
        prefixes.append(prefix.strip())
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"{flag} {' '.join(items)!r}: the weights sum to 0")
    return DataBlend(prefixes, [weight / total for weight in weights])


def blended_num_samples(weights: Sequence[float], num_samples: int) -> List[int]:
    """Samples asked of each blended dataset: ceil(num_samples * weight * 1.005)."""
    return [int(math.ceil(num_samples * weight * BLEND_OVERSAMPLE)) for weight in weights]


def get_train_valid_test_num_samples(
    global_batch_size: int,
    eval_interval: int,
    eval_iters: int,
    train_iters: int | None = None,
    train_samples: int | None = None,
) -> List[int]:
    """Megatron's [train, valid, test] sample counts.

    train = train_samples or train_iters * global_batch_size;
    valid = (train_iters // eval_interval + 1) * eval_iters * global_batch_size;
    test = eval_iters * global_batch_size. With only `train_samples`, train_iters is
    train_samples // global_batch_size (Megatron's count without batch-size ramp-up).
    """
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
    if eval_interval < 1:
        raise ValueError(f"eval_interval must be >= 1, got {eval_interval}")
    if eval_iters < 0:
        raise ValueError(f"eval_iters must be >= 0, got {eval_iters}")
    if train_iters is None and train_samples is None:
        raise ValueError("give train_iters (--train-iters) or train_samples (--train-samples)")
    if train_iters is None:
        train_iters = train_samples // global_batch_size
    train = train_samples if train_samples else train_iters * global_batch_size
    valid = (train_iters // eval_interval + 1) * eval_iters * global_batch_size
    test = eval_iters * global_batch_size
    return [train, valid, test]
