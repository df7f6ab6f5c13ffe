"""Datasets that cannot serve the run: `DatasetError`, and the check of a run's datasets.

A DatasetError's message is one line naming the dataset (prefix), the split, the numbers and
what to do; the builders in gpt_dataset.py and blended_dataset.py raise it as well.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron.data.dataset_splits import parse_data_path, parse_split_string
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.errors import UserError


class DatasetError(UserError, ValueError):
    """A dataset (prefix and split named in the message) cannot serve the run as asked.

    A `UserError`, so the entry point prints the message as one line and exits 1; a
    `ValueError`, as the dataset builders raised before it existed.
    """


def _prefixes_of(dataset: torch.utils.data.Dataset) -> str:
    parts = getattr(dataset, "datasets", [dataset])
    return ", ".join(getattr(part, "data_prefix", str(part)) for part in parts)


def check_datasets_serve_run(
    datasets: Sequence[torch.utils.data.Dataset | None],
    data_path: Sequence[str] | None,
    split: str,
    global_batch_size: int,
) -> None:
    """Raise DatasetError unless the train dataset (first of `datasets`) has a global batch.

    `data_path` and `split` are the run's --data-path and --split, named in the message.
    """
    train = datasets[0]
    if train is None and not data_path:
        raise DatasetError(
            "no --train-data-path was given (only --valid-data-path/--test-data-path), so "
            "there is nothing to train on; add --train-data-path PREFIX, or give --data-path "
            "and --split"
        )
    if train is None:
        counts = " and ".join(
            f"the {len(MMapIndexedDataset(prefix))} documents of {prefix}"
            for prefix in parse_data_path(data_path).prefixes
        )
        if parse_split_string(split)[0] == 0:
            fix = "give the first --split weight a positive value"
        else:
            fix = "give the train split a larger share of --split (its first weight)"
        raise DatasetError(
            f"--split {split} gives the train split none of {counts}: there is nothing to "
            f"train on; {fix}"
        )
    if len(train) < global_batch_size:
        raise DatasetError(
            f"{_prefixes_of(train)} (train split): {len(train)} samples, fewer than one global "
            f"batch of {global_batch_size} (--global-batch-size): train on at least one global "
            f"batch (--train-samples {global_batch_size} or more), or lower --global-batch-size"
        )
