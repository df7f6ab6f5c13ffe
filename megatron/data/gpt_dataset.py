"""GPT pretraining dataset: fixed-length samples cut from a shuffled stream of documents.

Same samples, in the same order, as Megatron-LM's legacy `GPTDataset` for the same data,
`--split`, sequence length, seed and sample counts; the index arrays are cached next to the
data under Megatron's file names, so caches from either framework can be reused.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Sequence, Tuple

import numpy as np
import torch

from megatron.data.blended_dataset import BlendedDataset
from megatron.data.dataset_splits import (
    blended_num_samples,
    get_train_valid_test_split,
    parse_data_path,
)
from megatron.data.index_helpers import build_gpt_indices
from megatron.data.indexed_dataset import MMapIndexedDataset

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")
INDEX_ARRAY_NAMES = ("doc_idx", "sample_idx", "shuffle_idx")


def index_cache_paths(
    data_prefix: str, name: str, num_samples: int, seq_length: int, seed: int
) -> dict[str, str]:
    """Megatron's legacy cache file of each index array, keyed by array name."""
    stem = f"{data_prefix}_{name}_indexmap_{num_samples}ns_{seq_length}sl_{seed}s"
    return {array: f"{stem}_{array}.npy" for array in INDEX_ARRAY_NAMES}


def _default_barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _is_global_rank_zero() -> bool:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return True


def _save_atomically(path: str, array: np.ndarray) -> None:
    # A reader (another job, or a rank that skipped the barrier) never sees a half-written file.
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temporary, "wb") as file:
            np.save(file, array, allow_pickle=True)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


class GPTDataset(torch.utils.data.Dataset):
    """`num_samples` (or more) samples of `seq_length + 1` tokens from `documents`.

    Index arrays are built by global rank 0 only and cached as .npy next to `data_prefix`;
    every rank then calls `barrier` and memory-maps them. The default barrier is
    `torch.distributed.barrier()` when a process group is initialized; callers that build
    datasets on a subset of ranks must pass a barrier over exactly those ranks.
    """

    def __init__(
        self,
        name: str,
        data_prefix: str,
        documents: np.ndarray,
        indexed_dataset: MMapIndexedDataset,
        num_samples: int,
        seq_length: int,
        seed: int,
        use_cpp: bool | None = None,
        barrier: Callable[[], None] | None = None,
    ):
        self.name = name
        self.data_prefix = data_prefix
        self.indexed_dataset = indexed_dataset
        self.seq_length = seq_length
        documents = np.asarray(documents)
        if documents.size == 0:
            raise ValueError(f"{data_prefix} ({name}): no documents given")
        if documents.min() < 0 or documents.max() >= indexed_dataset.sizes.shape[0]:
            raise ValueError(
                f"{data_prefix} ({name}): documents span [{documents.min()}, {documents.max()}] "
                f"but the dataset has {indexed_dataset.sizes.shape[0]} sequences"
            )
        self.index_paths = index_cache_paths(data_prefix, name, num_samples, seq_length, seed)
        if _is_global_rank_zero() and not all(map(os.path.isfile, self.index_paths.values())):
            logger.info("building %s indices for %s (%d samples)", name, data_prefix, num_samples)
            try:
                indices = build_gpt_indices(
                    documents, indexed_dataset.sizes, num_samples, seq_length, seed, use_cpp
                )
            except ValueError as error:
                raise ValueError(f"{data_prefix} ({name} split): {error}") from None
            logger.info(
                "%s: %d tokens per epoch, %d epochs, separate last epoch: %s",
                name,
                indices.plan.tokens_per_epoch,
                indices.plan.num_epochs,
                indices.plan.separate_last_epoch,
            )
            for array_name in INDEX_ARRAY_NAMES:
                _save_atomically(self.index_paths[array_name], getattr(indices, array_name))
        (barrier or _default_barrier)()
        self.doc_idx, self.sample_idx, self.shuffle_idx = (
            np.load(self.index_paths[array_name], allow_pickle=True, mmap_mode="r")
            for array_name in INDEX_ARRAY_NAMES
        )

    def __len__(self) -> int:
        # Sample i spans rows i and i+1 of sample_idx.
        return self.sample_idx.shape[0] - 1

    def __getitem__(self, idx: int) -> dict:
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {self.name} ({len(self)} samples)")
        idx = int(self.shuffle_idx[idx])
        first_doc_position, first_offset = (int(value) for value in self.sample_idx[idx])
        last_doc_position, last_offset = (int(value) for value in self.sample_idx[idx + 1])
        get = self.indexed_dataset.get
        if first_doc_position == last_doc_position:
            tokens = get(
                int(self.doc_idx[first_doc_position]),
                offset=first_offset,
                length=last_offset - first_offset + 1,
            )
        else:
            pieces = [get(int(self.doc_idx[first_doc_position]), offset=first_offset)]
            for position in range(first_doc_position + 1, last_doc_position):
                pieces.append(get(int(self.doc_idx[position])))
            pieces.append(get(int(self.doc_idx[last_doc_position]), length=last_offset + 1))
            tokens = np.concatenate(pieces)
        return {"text": np.asarray(tokens, dtype=np.int64)}


def _split_documents(split: str, num_documents: int) -> list[np.ndarray | None]:
    boundaries = get_train_valid_test_split(split, num_documents)
    documents = []
    for index in range(len(SPLIT_NAMES)):
        start, stop = boundaries[index], boundaries[index + 1]
        documents.append(np.arange(start, stop, dtype=np.int32) if stop > start else None)
    return documents


def _build_split_datasets(
    data_prefix: str,
    split: str,
    num_samples: Sequence[int],
    seq_length: int,
    seed: int,
    use_cpp: bool | None,
    barrier: Callable[[], None] | None,
) -> list[GPTDataset | None]:
    indexed_dataset = MMapIndexedDataset(data_prefix)
    datasets = []
    for name, documents, count in zip(
        SPLIT_NAMES, _split_documents(split, len(indexed_dataset)), num_samples
    ):
        if documents is None:
            datasets.append(None)
            continue
        logger.info("%s %s: documents [%d, %d)", data_prefix, name, documents[0], documents[-1] + 1)
        datasets.append(
            GPTDataset(
                name,
                data_prefix,
                documents,
                indexed_dataset,
                count,
                seq_length,
                seed,
                use_cpp,
                barrier,
            )
        )
    return datasets


def _blend(
    name: str,
    prefixes: Sequence[str],
    datasets: Sequence[GPTDataset | None],
    weights: Sequence[float],
    size: int,
    use_cpp: bool | None,
) -> torch.utils.data.Dataset | None:
    missing = [prefix for prefix, dataset in zip(prefixes, datasets) if dataset is None]
    if len(missing) == len(prefixes):
        return None
    if missing:
        raise ValueError(
            f"the {name} split is empty for {', '.join(missing)} but not for the other blended "
            "datasets; adjust --split or the blend so every dataset has documents in it"
        )
    return BlendedDataset(list(datasets), weights, size, use_cpp=use_cpp)


def build_dataset(
    name: str,
    data_path: Sequence[str],
    num_samples: int,
    seq_length: int,
    seed: int,
    use_cpp: bool | None = None,
    barrier: Callable[[], None] | None = None,
    flag: str = "--data-path",
) -> torch.utils.data.Dataset:
    """One split from `data_path` (a prefix or a weighted blend), using all documents of each."""
    blend = parse_data_path(data_path, flag)

    def whole(prefix: str, count: int) -> GPTDataset:
        indexed_dataset = MMapIndexedDataset(prefix)
        documents = np.arange(0, len(indexed_dataset), dtype=np.int32)
        return GPTDataset(
            name, prefix, documents, indexed_dataset, count, seq_length, seed, use_cpp, barrier
        )

    if not blend.is_blended:
        return whole(blend.prefixes[0], num_samples)
    counts = blended_num_samples(blend.weights, num_samples)
    datasets = [whole(prefix, count) for prefix, count in zip(blend.prefixes, counts)]
    return BlendedDataset(datasets, blend.weights, sum(counts), use_cpp=use_cpp)


def build_train_valid_test_datasets(
    data_path: Sequence[str] | None,
    split: str,
    train_valid_test_num_samples: Sequence[int],
    seq_length: int,
    seed: int,
    train_data_path: Sequence[str] | None = None,
    valid_data_path: Sequence[str] | None = None,
    test_data_path: Sequence[str] | None = None,
    use_cpp: bool | None = None,
    barrier: Callable[[], None] | None = None,
) -> Tuple[torch.utils.data.Dataset | None, ...]:
    """Train, valid and test datasets as Megatron builds them (None where a split is empty).

    `data_path` is divided by `split`; without it, `train_data_path`, `valid_data_path` and
    `test_data_path` each give one split using all their documents. A blended split is
    as long as the sum of the per-dataset sample counts, as in Megatron.
    """
    if len(train_valid_test_num_samples) != 3:
        raise ValueError(
            f"train_valid_test_num_samples must have 3 entries, got {train_valid_test_num_samples!r}"
        )
    if not data_path:
        separate = (train_data_path, valid_data_path, test_data_path)
        if not any(separate):
            raise ValueError(
                "no data: give --data-path, or --train-data-path/--valid-data-path/--test-data-path"
            )
        return tuple(
            build_dataset(
                name, paths, count, seq_length, seed, use_cpp, barrier, f"--{name}-data-path"
            )
            if paths
            else None
            for name, paths, count in zip(SPLIT_NAMES, separate, train_valid_test_num_samples)
        )

    blend = parse_data_path(data_path)
    if not blend.is_blended:
        return tuple(
            _build_split_datasets(
                blend.prefixes[0],
                split,
                train_valid_test_num_samples,
                seq_length,
                seed,
                use_cpp,
                barrier,
            )
        )
    per_dataset_counts = [
        blended_num_samples(blend.weights, count) for count in train_valid_test_num_samples
    ]
    per_prefix_datasets = [
        _build_split_datasets(
            prefix,
            split,
            [counts[index] for counts in per_dataset_counts],
            seq_length,
            seed,
            use_cpp,
            barrier,
        )
        for index, prefix in enumerate(blend.prefixes)
    ]
    return tuple(
        _blend(
            name,
            blend.prefixes,
            [datasets[split_index] for datasets in per_prefix_datasets],
            blend.weights,
            sum(per_dataset_counts[split_index]),
            use_cpp,
        )
        for split_index, name in enumerate(SPLIT_NAMES)
    )
