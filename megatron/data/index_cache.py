"""The on-disk cache of a GPT dataset's index arrays, keyed on everything that determines them.

Next to the dataset (or in the directory --data-cache-path names, Megatron-Core's flag for a
dataset directory that is read-only or shared), under Megatron's legacy stem followed by the
hash of a description:

    {prefix}_{split}_indexmap_{N}ns_{L}sl_{S}s_{hash}_doc_idx.npy      (and _sample_idx, _shuffle_idx)
    {prefix}_{split}_indexmap_{N}ns_{L}sl_{S}s_{hash}_description.json

Megatron's legacy names hold only the sample count N, sequence length L and seed S, so another
`--split`, or a dataset re-created under the same prefix, silently reused arrays built for other
documents. As Megatron-Core does, the description (a JSON object, keys sorted) names everything
the arrays depend on: this cache's format version, the class and split name, the normalized
`--split` (None when all documents are used) and the resulting documents (a range, or a hash),
N, L, S, the separate-last-epoch threshold and decision, the blend the dataset belongs to, and
the identity of the `.bin`/`.idx` pair (their sizes and the sha256 of the `.idx`). `hash` is the
first 16 hex digits of the description's sha256.

The arrays are written first and the JSON last, each atomically: the JSON is the commit marker.
Besides the description it records what building learned: the epoch plan, each array's dtype and
shape, and the largest token id of the split's documents (checked against the vocabulary on every
run without reading the tokens again). A cache is used only when its JSON parses, holds this very
description, and the arrays memory-map with the recorded dtypes and shapes and fit each other;
anything else (missing, truncated, garbled, from another build) is rebuilt.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np

from megatron.console import print_line
from megatron.data.errors import DatasetError
from megatron.data.index_helpers import SEPARATE_LAST_EPOCH_THRESHOLD, EpochPlan, GPTIndices
from megatron.data.indexed_dataset import MMapIndexedDataset, data_file_path, index_file_path

CACHE_FORMAT_VERSION = 1
INDEX_ARRAY_NAMES = ("doc_idx", "sample_idx", "shuffle_idx")
DESCRIPTION_HASH_LENGTH = 16
# Bounds the memory of the largest-token-id scan; 16M uint16 tokens are 32 MiB.
TOKENS_PER_CHUNK = 1 << 24
_HASH_READ_BYTES = 1 << 22


def legacy_stem(data_prefix: str, name: str, num_samples: int, seq_length: int, seed: int) -> str:
    """Megatron's legacy cache stem, which the hashed names extend."""
    return f"{data_prefix}_{name}_indexmap_{num_samples}ns_{seq_length}sl_{seed}s"


@functools.lru_cache(maxsize=64)
def _file_sha256(path: str, device: int, inode: int, size: int, mtime_ns: int) -> str:
    # Keyed on the file's stat as well, so the splits and blends of one run hash an .idx once
    # while a file re-created under the same name is hashed again.
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(_HASH_READ_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def indexed_dataset_identity(prefix: str) -> dict:
    """Byte sizes of `prefix`'s .bin and .idx and the sha256 of the .idx."""
    index_path = index_file_path(prefix)
    status = os.stat(index_path)
    return {
        "bin_bytes": os.path.getsize(data_file_path(prefix)),
        "idx_bytes": status.st_size,
        "idx_sha256": _file_sha256(
            os.path.realpath(index_path),
            status.st_dev,
            status.st_ino,
            status.st_size,
            status.st_mtime_ns,
        ),
    }


def contiguous_range(documents: np.ndarray) -> tuple[int, int] | None:
    """(start, stop) when `documents` is exactly start, start+1, ..., stop-1; else None."""
    if documents.size == 0:
        return None
    start, stop = int(documents[0]), int(documents[-1]) + 1
    if stop - start != documents.size or not np.all(np.diff(documents) == 1):
        return None
    return start, stop


def describe_documents(documents: np.ndarray) -> dict:
    """{"start", "stop"} for a contiguous range, else the count and sha256 of the int64 ids."""
    document_range = contiguous_range(documents)
    if document_range is not None:
        return {"start": document_range[0], "stop": document_range[1]}
    ids = np.ascontiguousarray(documents, dtype=np.int64)
    return {"count": int(ids.size), "sha256": hashlib.sha256(ids.tobytes()).hexdigest()}


def describe_gpt_indices(
    class_name: str,
    name: str,
    data_prefix: str,
    split_fractions: Sequence[float] | None,
    documents: np.ndarray,
    num_samples: int,
    seq_length: int,
    seed: int,
    plan: EpochPlan,
    blend: dict | None,
) -> dict:
    """The description of the index arrays of one split of one dataset (see the module doc);
    `data_prefix` names the .bin/.idx pair whose identity it records."""
    return {
        "cache_format": CACHE_FORMAT_VERSION,
        "class": class_name,
        "split_name": name,
        "split": None if split_fractions is None else [float(f) for f in split_fractions],
        "documents": describe_documents(documents),
        "num_samples": int(num_samples),
        "seq_length": int(seq_length),
        "seed": int(seed),
        "separate_last_epoch_threshold": SEPARATE_LAST_EPOCH_THRESHOLD,
        "separate_last_epoch": bool(plan.separate_last_epoch),
        "blend": blend,
        "indexed_dataset": indexed_dataset_identity(data_prefix),
    }


def largest_token_id(indexed_dataset: MMapIndexedDataset, documents: np.ndarray) -> int:
    """The largest token id in `documents`, read in chunks of at most TOKENS_PER_CHUNK tokens.

    The documents of a run of consecutive ids lie back to back in the .bin, so each run is one
    slice of the memory-mapped tokens. Raises ValueError when the documents hold no tokens.
    """
    sizes, pointers = indexed_dataset.sizes, indexed_dataset.pointers
    itemsize = indexed_dataset.dtype.itemsize
    ids = np.unique(np.asarray(documents, dtype=np.int64))
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    run_starts = ids[np.concatenate(([0], breaks))]
    run_stops = ids[np.concatenate((breaks - 1, [ids.size - 1]))] + 1
    tokens = None
    largest = None
    for run_start, run_stop in zip(run_starts.tolist(), run_stops.tolist()):
        first = int(pointers[run_start]) // itemsize
        stop = first + int(sizes[run_start:run_stop].sum(dtype=np.int64))
        if stop == first:
            continue
        if tokens is None:
            path = data_file_path(indexed_dataset.prefix)
            tokens = np.memmap(path, dtype=indexed_dataset.dtype, mode="r")
        for chunk_start in range(first, stop, TOKENS_PER_CHUNK):
            chunk_max = int(tokens[chunk_start : min(stop, chunk_start + TOKENS_PER_CHUNK)].max())
            largest = chunk_max if largest is None else max(largest, chunk_max)
    if largest is None:
        raise ValueError(f"the {ids.size} documents hold no tokens")
    return largest


@dataclass
class CachedIndices:
    """The three arrays, memory-mapped, and what the JSON recorded about them."""

    doc_idx: np.ndarray
    sample_idx: np.ndarray
    shuffle_idx: np.ndarray
    max_token_id: int
    epoch_plan: EpochPlan


class CacheUnusable(Exception):
    """Why a cache cannot be used; the message fits in a log line."""


def _write_atomically(path: str, write: Callable) -> None:
    # Readers (another job, or a rank that skipped the barrier) never see a half-written file,
    # and the data is on disk before the rename that makes it visible.
    directory, base = os.path.split(path)
    handle, temporary = tempfile.mkstemp(prefix=f"{base}.", suffix=".tmp", dir=directory or ".")
    try:
        with os.fdopen(handle, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def _check_arrays(arrays: dict, recorded: dict) -> None:
    doc_idx, sample_idx, shuffle_idx = (arrays[name] for name in INDEX_ARRAY_NAMES)
    if doc_idx.dtype != np.int32 or doc_idx.ndim != 1 or doc_idx.size == 0:
        raise CacheUnusable(f"doc_idx is {doc_idx.dtype} of shape {doc_idx.shape}")
    if sample_idx.dtype != np.int32 or sample_idx.ndim != 2 or sample_idx.shape[1] != 2:
        raise CacheUnusable(f"sample_idx is {sample_idx.dtype} of shape {sample_idx.shape}")
    if shuffle_idx.dtype not in (np.uint32, np.int64) or shuffle_idx.ndim != 1:
        raise CacheUnusable(f"shuffle_idx is {shuffle_idx.dtype} of shape {shuffle_idx.shape}")
    if len(shuffle_idx) != len(sample_idx) - 1:
        raise CacheUnusable(
            f"shuffle_idx has {len(shuffle_idx)} entries for {len(sample_idx) - 1} samples"
        )
    for name, array in arrays.items():
        if recorded.get(name) != {"dtype": array.dtype.str, "shape": list(array.shape)}:
            raise CacheUnusable(
                f"the cached {name} ({array.dtype.str}, {list(array.shape)}) is not the one "
                f"recorded ({recorded.get(name)})"
            )


class IndexCache:
    """The cache files of one description; `load` and `save` follow the module docstring."""

    def __init__(
        self, stem_without_hash: str, description: dict, cache_path: str | None = None
    ) -> None:
        text = json.dumps(description, sort_keys=True)
        # Compared as it reads back from the file (tuples become lists).
        self.description = json.loads(text)
        self.hash = hashlib.sha256(text.encode()).hexdigest()[:DESCRIPTION_HASH_LENGTH]
        # --data-cache-path keeps the file names and moves them out of the dataset's directory.
        if cache_path is not None:
            stem_without_hash = os.path.join(cache_path, os.path.basename(stem_without_hash))
        self.cache_path = cache_path
        self.directory = os.path.dirname(stem_without_hash) or "."
        self.stem = f"{stem_without_hash}_{self.hash}"
        self.paths = {name: f"{self.stem}_{name}.npy" for name in INDEX_ARRAY_NAMES}
        self.paths["description"] = f"{self.stem}_description.json"

    @property
    def name(self) -> str:
        """The stem without its directory, as log lines show it."""
        return os.path.basename(self.stem)

    def load(self) -> CachedIndices:
        """The cached arrays, memory-mapped; raises CacheUnusable saying why not."""
        path = self.paths["description"]
        if not os.path.isfile(path):
            raise CacheUnusable("no cache with this description")
        try:
            with open(path, encoding="utf-8") as file:
                record = json.load(file)
        except (OSError, ValueError) as error:
            raise CacheUnusable(f"its description file is unreadable ({error})") from None
        if not isinstance(record, dict) or record.get("description") != self.description:
            raise CacheUnusable("its description file does not hold this description")
        try:
            max_token_id, epoch_plan = record["max_token_id"], EpochPlan(**record["epoch_plan"])
            if not isinstance(max_token_id, int):
                raise TypeError(max_token_id)
        except (KeyError, TypeError):
            raise CacheUnusable(
                "its description file lacks the largest token id or epoch plan"
            ) from None
        arrays = {}
        for name in INDEX_ARRAY_NAMES:
            try:
                arrays[name] = np.load(self.paths[name], mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError, EOFError) as error:
                reason = error.strerror if isinstance(error, OSError) and error.strerror else error
                raise CacheUnusable(f"the cached {name} is unreadable ({reason})") from None
        _check_arrays(arrays, record.get("arrays") or {})
        return CachedIndices(**arrays, max_token_id=max_token_id, epoch_plan=epoch_plan)

    def save(self, indices: GPTIndices, max_token_id: int) -> None:
        """Write the arrays, then the JSON that commits them."""
        if self.cache_path is not None:
            os.makedirs(self.cache_path, exist_ok=True)
        if os.path.exists(self.paths["description"]):
            os.remove(self.paths["description"])  # uncommit a damaged cache before rewriting it
        arrays = [getattr(indices, name) for name in INDEX_ARRAY_NAMES]
        for name, array in zip(INDEX_ARRAY_NAMES, arrays):
            _write_atomically(
                self.paths[name], lambda file, array=array: np.save(file, array, allow_pickle=False)
            )
        record = {
            "description": self.description,
            "description_hash": self.hash,
            "max_token_id": int(max_token_id),
            "epoch_plan": {key: _plain(value) for key, value in asdict(indices.plan).items()},
            "arrays": {
                name: {"dtype": array.dtype.str, "shape": list(array.shape)}
                for name, array in zip(INDEX_ARRAY_NAMES, arrays)
            },
        }
        text = json.dumps(record, indent=2, sort_keys=True) + "\n"
        _write_atomically(self.paths["description"], lambda file: file.write(text.encode()))


def _plain(value):
    return value if isinstance(value, bool) else int(value)


def load_or_build(
    cache: IndexCache,
    build: Callable[[], tuple[GPTIndices, int]],
    what: str,
    summary: str,
    where: str,
    barrier: Callable[[], None],
    is_global_rank_zero: bool,
) -> CachedIndices:
    """Global rank 0 loads `cache`, or builds (`build()` gives the indices and the largest token
    id) and saves it, printing one line saying which; after `barrier` the other ranks load it.

    `what` ("train indices for PREFIX") and `summary` fill the log line, `where`
    ("PREFIX (train split)") starts error messages.
    """
    cached = None
    if is_global_rank_zero:
        try:
            cached = cache.load()
            print_line(f" > loading {what} from cache {cache.name}: {summary}")
        except CacheUnusable as problem:
            print_line(f" > building {what} (cache {cache.name}: {problem}): {summary}")
            indices, max_token_id = build()
            try:
                cache.save(indices, max_token_id)
            except OSError as error:
                raise DatasetError(_unwritable(cache, where, error)) from None
    barrier()
    if cached is None:
        try:
            cached = cache.load()
        except CacheUnusable as problem:
            rank = "global rank 0" if is_global_rank_zero else "this rank"
            raise DatasetError(
                f"{where}: {rank} cannot read back the index cache {cache.stem} that global "
                f"rank 0 wrote ({problem}): every rank must see it on a shared filesystem"
            ) from None
    return cached


def _unwritable(cache: IndexCache, where: str, error: OSError) -> str:
    reason = error.strerror or error
    if cache.cache_path is not None:
        return (
            f"{where}: cannot write the index cache {cache.name} into --data-cache-path "
            f"{cache.cache_path} ({reason}): global rank 0 must be able to write there"
        )
    return (
        f"{where}: cannot write the index cache {cache.name} beside the data in "
        f"{cache.directory} ({reason}): give --data-cache-path DIR, a directory global rank 0 "
        "can write and every rank can read"
    )
