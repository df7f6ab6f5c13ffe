"""GPT pretraining dataset: fixed-length samples cut from a shuffled stream of documents.

Same samples, in the same order, as Megatron-LM's legacy `GPTDataset` for the same data,
`--split`, sequence length, seed and sample counts. The index arrays are byte-identical to
Megatron's, but cached under Megatron's legacy stem followed by the hash of a description of
everything they depend on (megatron/data/index_cache.py): the legacy names hold only samples,
length and seed, so another `--split` or a re-created dataset silently reused stale arrays.
Caches written by Megatron-LM are therefore not reused here, nor ours by it.

Datasets that cannot serve a run (a split without documents or tokens, token ids beyond the
vocabulary, files missing) raise `DatasetError`, one line naming the dataset, split and fix.
"""

from __future__ import annotations

from typing import Callable, Sequence, Tuple

import numpy as np
import torch

from megatron.data.blended_dataset import BlendedDataset
from megatron.data.dataset_splits import (
    DataBlend,
    blended_num_samples,
    get_train_valid_test_split,
    parse_data_path,
    parse_split_string,
)
from megatron.data.errors import DatasetError
from megatron.data.index_cache import (
    IndexCache,
    contiguous_range,
    describe_gpt_indices,
    largest_token_id,
    legacy_stem,
    load_or_build,
)
from megatron.data.index_helpers import GPTIndices, build_gpt_indices, plan_epochs
from megatron.data.indexed_dataset import IndexedDatasetError, MMapIndexedDataset

SPLIT_NAMES = ("train", "valid", "test")


def _default_barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _is_global_rank_zero() -> bool:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return True


def _open_indexed_dataset(prefix: str, flag: str) -> MMapIndexedDataset:
    try:
        return MMapIndexedDataset(prefix)
    except IndexedDatasetError as error:
        raise DatasetError(f"{flag} {prefix}: {error}") from error


class GPTDataset(torch.utils.data.Dataset):
    """`num_samples` (or more) samples of `seq_length + 1` tokens from `documents`.

    Index arrays are built by global rank 0 only and cached next to `data_prefix`, or in
    `cache_path` when given (megatron/data/index_cache.py); every rank then calls `barrier` and memory-maps them. The
    default barrier is `torch.distributed.barrier()` when a process group is initialized;
    callers that build datasets on a subset of ranks must pass a barrier over exactly those
    ranks. `split` (the `--split` string, None when all documents are used) and `blend` (the
    blend this dataset is part of) only enter the cache's description. With `vocab_size`, a
    token id at or above it raises DatasetError (checked once, from the cache's record).
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
        *,
        split: str | None = None,
        blend: DataBlend | None = None,
        vocab_size: int | None = None,
        cache_path: str | None = None,
    ):
        self.name = name
        self.data_prefix = data_prefix
        self.indexed_dataset = indexed_dataset
        self.seq_length = seq_length
        where = f"{data_prefix} ({name} split)"
        documents = np.asarray(documents)
        if documents.size == 0:
            raise DatasetError(f"{where}: no documents given")
        num_documents = indexed_dataset.sizes.shape[0]
        if documents.min() < 0 or documents.max() >= num_documents:
            raise ValueError(
                f"{where}: documents span [{documents.min()}, {documents.max()}] "
                f"but the dataset has {num_documents} sequences"
            )
        document_range = contiguous_range(documents)
        if document_range is not None:
            start, stop = document_range
            tokens_per_epoch = int(indexed_dataset.sizes[start:stop].sum(dtype=np.int64))
            which = f"[{start}, {stop})"
        else:
            tokens_per_epoch = int(np.sum(indexed_dataset.sizes[documents], dtype=np.int64))
            which = "(not a contiguous range)"
        count = documents.size
        summary = f"{count} of {num_documents} documents {which}"
        if tokens_per_epoch == 0:
            documents_hold = "documents {} hold" if count > 1 else "document {} holds"
            raise DatasetError(
                f"{where}: the {count} {documents_hold.format(which)} no tokens, so there is "
                "nothing to cut samples from; preprocess the data again (check --json-keys; "
                "with --keep-empty, add --append-eod) or leave this dataset out"
            )
        plan = plan_epochs(tokens_per_epoch, seq_length, num_samples)
        description = describe_gpt_indices(
            type(self).__name__,
            name,
            indexed_dataset.prefix,
            None if split is None else parse_split_string(split),
            documents,
            num_samples,
            seq_length,
            seed,
            plan,
            None if blend is None else {"weights": blend.weights, "prefixes": blend.prefixes},
        )
        cache = IndexCache(
            legacy_stem(data_prefix, name, num_samples, seq_length, seed), description, cache_path
        )
        self.index_paths = cache.paths
        self.description_hash = cache.hash
        epochs = f"{plan.num_epochs} epoch{'s' if plan.num_epochs > 1 else ''}"
        if plan.separate_last_epoch:
            epochs += " (the last shuffled on its own)"

        def build() -> tuple[GPTIndices, int]:
            try:
                indices = build_gpt_indices(
                    documents, indexed_dataset.sizes, num_samples, seq_length, seed, use_cpp
                )
            except ValueError as error:
                raise ValueError(f"{where}: {error}") from None
            return indices, largest_token_id(indexed_dataset, documents)

        cached = load_or_build(
            cache,
            build,
            f"{name} indices for {data_prefix}",
            f"{summary}, {num_samples} samples, {epochs}",
            where,
            barrier or _default_barrier,
            _is_global_rank_zero(),
        )
        self.doc_idx, self.sample_idx = cached.doc_idx, cached.sample_idx
        self.shuffle_idx = cached.shuffle_idx
        self.max_token_id = cached.max_token_id
        self.epoch_plan = cached.epoch_plan
        if vocab_size is not None and self.max_token_id >= vocab_size:
            raise DatasetError(
                f"{where}: token id {self.max_token_id} is at or above the padded vocabulary "
                f"size {vocab_size} of this run's tokenizer: the data was tokenized with another "
                "vocabulary; preprocess it with this run's --vocab-file/--merge-file "
                "(or --tokenizer-model)"
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
    blend: DataBlend | None,
    vocab_size: int | None,
    cache_path: str | None,
) -> list[GPTDataset | None]:
    indexed_dataset = _open_indexed_dataset(data_prefix, "--data-path")
    datasets = []
    for name, documents, count in zip(
        SPLIT_NAMES, _split_documents(split, len(indexed_dataset)), num_samples
    ):
        if documents is None:
            datasets.append(None)
            continue
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
                split=split,
                blend=blend,
                vocab_size=vocab_size,
                cache_path=cache_path,
            )
        )
    return datasets


def _blend(
    name: str,
    split: str,
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
        counts = " and ".join(
            f"the {len(_open_indexed_dataset(prefix, '--data-path'))} documents of {prefix}"
            for prefix in missing
        )
        raise DatasetError(
            f"--split {split} gives the {name} split none of {counts} but some documents of "
            f"the other blended datasets; adjust --split or the blend so that every blended "
            f"dataset has documents in the {name} split"
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
    vocab_size: int | None = None,
    cache_path: str | None = None,
) -> torch.utils.data.Dataset:
    """One split from `data_path` (a prefix or a weighted blend), using all documents of each;
    index caches in `cache_path` (--data-cache-path) when given, else beside the data."""
    blend = parse_data_path(data_path, flag)

    def whole(prefix: str, count: int) -> GPTDataset:
        indexed_dataset = _open_indexed_dataset(prefix, flag)
        documents = np.arange(0, len(indexed_dataset), dtype=np.int32)
        if documents.size == 0:
            raise DatasetError(f"{flag} {prefix}: the dataset holds no documents")
        return GPTDataset(
            name,
            prefix,
            documents,
            indexed_dataset,
            count,
            seq_length,
            seed,
            use_cpp,
            barrier,
            blend=blend if blend.is_blended else None,
            vocab_size=vocab_size,
            cache_path=cache_path,
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
    vocab_size: int | None = None,
    cache_path: str | None = None,
) -> Tuple[torch.utils.data.Dataset | None, ...]:
    """Train, valid and test datasets as Megatron builds them (None where a split is empty).

    `data_path` is divided by `split`; without it, `train_data_path`, `valid_data_path` and
    `test_data_path` each give one split using all their documents. A blended split is
    as long as the sum of the per-dataset sample counts, as in Megatron. With `vocab_size`
    (the padded vocabulary), token ids at or above it raise DatasetError. The index caches go
    to `cache_path` (--data-cache-path) when given, else beside each dataset.
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
                name,
                paths,
                count,
                seq_length,
                seed,
                use_cpp,
                barrier,
                f"--{name}-data-path",
                vocab_size,
                cache_path,
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
                None,
                vocab_size,
                cache_path,
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
            blend,
            vocab_size,
            cache_path,
        )
        for index, prefix in enumerate(blend.prefixes)
    ]
    return tuple(
        _blend(
            name,
            split,
            blend.prefixes,
            [datasets[split_index] for datasets in per_prefix_datasets],
            blend.weights,
            sum(per_dataset_counts[split_index]),
            use_cpp,
        )
        for split_index, name in enumerate(SPLIT_NAMES)
    )
