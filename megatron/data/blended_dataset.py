"""Weighted mixture of datasets (`--data-path 0.3 A 0.7 B`), in Megatron's sample order."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from megatron.data.index_helpers import build_blending_indices


class BlendedDataset(torch.utils.data.Dataset):
    """`size` samples drawn from `datasets` in proportion to `weights` (normalized here).

    Sample i is sample `dataset_sample_index[i]` of dataset `dataset_index[i]`, chosen by
    Megatron's greedy blending so that every prefix of the stream tracks the weights closely.
    """

    def __init__(
        self,
        datasets: Sequence[torch.utils.data.Dataset],
        weights: Sequence[float],
        size: int,
        use_cpp: bool | None = None,
    ):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        if not 1 <= len(datasets) < 255:
            raise ValueError(f"blending supports 1 to 254 datasets, got {len(datasets)}")
        weights = np.array(weights, dtype=np.float64)
        if np.any(weights < 0) or not weights.sum() > 0:
            raise ValueError(
                f"blend weights must be >= 0 with a positive sum, got {weights.tolist()}"
            )
        self.datasets = list(datasets)
        self.weights = weights / weights.sum()
        self.size = int(size)
        self.dataset_index, self.dataset_sample_index = build_blending_indices(
            self.weights, self.size, use_cpp=use_cpp
        )
        # Fail now, by name, rather than with an IndexError deep inside training.
        drawn_per_dataset = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for dataset_number, (dataset, drawn) in enumerate(zip(self.datasets, drawn_per_dataset)):
            if drawn > len(dataset):
                raise ValueError(
                    f"blended dataset {dataset_number} ({getattr(dataset, 'data_prefix', dataset)}) "
                    f"has {len(dataset)} samples but the blend of {self.size} draws {drawn} from it"
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int):
        if not -self.size <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for a blend of {self.size} samples")
        dataset_number = int(self.dataset_index[idx])
        return self.datasets[dataset_number][int(self.dataset_sample_index[idx])]
