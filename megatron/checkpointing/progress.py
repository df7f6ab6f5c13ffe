"""Progress of the offline tools that read and write whole checkpoints (format conversion,
Hugging Face export and import), where a user waits minutes on a large model.

tqdm on standard error, shown only when it is a terminal: a log file or a pipe (CI, a test, a
job scheduler) gets nothing, so the tools' own lines stay as they were.
"""

from __future__ import annotations

import sys
from typing import IO, Any, Iterator, List, Optional, Sequence, Tuple, TypeVar

import torch
from tqdm import tqdm

Item = TypeVar("Item")


def progress_bar(
    description: str, total: Optional[int], unit: str, file: Optional[IO[str]] = None
) -> tqdm:
    """A tqdm bar of `total` `unit`s ("B" scales to kB, MB, ...), disabled off a terminal.
    Update it with `.update(n)` and close it (or use it as a context manager)."""
    return tqdm(
        total=total,
        desc=description,
        unit=unit,
        unit_scale=unit == "B",
        file=file if file is not None else sys.stderr,
        disable=None,  # tqdm's "only on a TTY"
        leave=False,
        dynamic_ncols=True,
    )


def batches_by_bytes(
    items: Sequence[Tuple[Item, int]], batch_bytes: int
) -> Iterator[Tuple[List[Item], int]]:
    """`items` (each with its size in bytes) in consecutive batches of about `batch_bytes` (an
    item larger than that alone), with each batch's bytes: units of work a bar can count."""
    batch: List[Item] = []
    size = 0
    for item, item_bytes in items:
        if batch and size + item_bytes > batch_bytes:
            yield batch, size
            batch, size = [], 0
        batch.append(item)
        size += item_bytes
    if batch:
        yield batch, size


def tensor_bytes(state: Any) -> int:
    """The bytes of every tensor in `state` (nested dicts, lists and tuples): about what a save
    of it writes, a bar's total."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(value) for value in state)
    return 0
