"""Index builders for the GPT dataset and dataset blending, byte-compatible with Megatron-LM.

A GPT dataset is read through three arrays (Megatron's legacy `gpt_dataset.py` layout):

- `doc_idx` (int32): the documents of every epoch, each epoch's order shuffled.
- `sample_idx` (int32, `[num_samples + 1, 2]`): row k is (position in `doc_idx`, token offset)
  where sample k starts; sample k runs to row k+1 inclusive, so it holds `seq_length + 1`
  tokens and shares its last token with the next sample.
- `shuffle_idx` (uint32, int64 when huge): the order in which samples are served.

`build_sample_idx` and `build_blending_indices` use the C++ extension `_index_helpers_cpp`
when it is built and an equivalent numpy / Python implementation otherwise; `use_cpp=False`
forces the fallback, `use_cpp=True` requires the extension.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

try:
    from megatron.data import _index_helpers_cpp
except ImportError:  # no compiler at install time: the fallback computes the same arrays
    _index_helpers_cpp = None

# Megatron separates the last epoch when it would fill less than this share of an epoch.
SEPARATE_LAST_EPOCH_THRESHOLD = 0.80


def cpp_helpers_available() -> bool:
    """True when the C++ extension was built (`pip install -e .` or `setup.py build_ext`)."""
    return _index_helpers_cpp is not None


def _want_cpp(use_cpp: bool | None) -> bool:
    if use_cpp is None:
        return cpp_helpers_available()
    if use_cpp and not cpp_helpers_available():
        raise RuntimeError(
            "use_cpp=True but megatron.data._index_helpers_cpp is not built; run "
            "`pip install -e . --no-deps --no-build-isolation` or "
            "`python setup.py build_ext --inplace` in the repository root"
        )
    return bool(use_cpp)


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Smallest epoch count e with (e * tokens_per_epoch - 1) // seq_length >= num_samples."""
    if tokens_per_epoch < 1:
        raise ValueError(f"tokens_per_epoch must be >= 1, got {tokens_per_epoch} (no tokens)")
    if seq_length < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}")
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    # (e*T - 1) // L >= N  <=>  e*T >= N*L + 1, hence a ceiling division.
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


@dataclass(frozen=True)
class EpochPlan:
    """How many epochs a dataset needs and whether the last one is shuffled on its own."""

    tokens_per_epoch: int
    num_epochs: int
    separate_last_epoch: bool
    # Samples covered by all epochs but the last; only meaningful when num_epochs > 1.
    num_samples_from_epochs_minus_one: int


def plan_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int) -> EpochPlan:
    """Megatron's epoch count and separate-last-epoch decision for `num_samples` samples."""
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    if num_epochs == 1:
        return EpochPlan(tokens_per_epoch, 1, False, 0)
    from_epochs_minus_one = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    last_epoch_num_samples = num_samples - from_epochs_minus_one
    num_samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    if not 0 <= last_epoch_num_samples <= num_samples_per_epoch + 1:
        raise AssertionError(
            f"last epoch would hold {last_epoch_num_samples} samples, outside "
            f"[0, {num_samples_per_epoch + 1}] (tokens_per_epoch={tokens_per_epoch}, "
            f"seq_length={seq_length}, num_samples={num_samples})"
        )
    separate = last_epoch_num_samples < int(SEPARATE_LAST_EPOCH_THRESHOLD * num_samples_per_epoch)
    return EpochPlan(tokens_per_epoch, num_epochs, separate, from_epochs_minus_one)


def build_doc_idx(
    documents: np.ndarray,
    num_epochs: int,
    rng: np.random.RandomState,
    separate_last_epoch: bool,
) -> np.ndarray:
    """Documents repeated `num_epochs` times and shuffled (int32), Megatron's `doc_idx`.

    With `separate_last_epoch` the first num_epochs-1 epochs are shuffled together and the
    last epoch on its own, both with the same `rng`, so the last epoch's documents come last.
    """
    if separate_last_epoch and num_epochs > 1:
        first = build_doc_idx(documents, num_epochs - 1, rng, False)
        last = build_doc_idx(documents, 1, rng, False)
        return np.concatenate((first, last))
    doc_idx = np.tile(np.asarray(documents), num_epochs).astype(np.int32)
    rng.shuffle(doc_idx)
    return doc_idx


def build_sample_idx(
    sizes: np.ndarray,
    doc_idx: np.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    use_cpp: bool | None = None,
) -> np.ndarray:
    """Start (doc_idx position, offset) of every sample, `[num_samples + 1, 2]` int32.

    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length; row k points at token
    k * seq_length of the concatenation of the documents in `doc_idx` order.
    """
    sizes = np.ascontiguousarray(sizes, dtype=np.int32)
    doc_idx = np.ascontiguousarray(doc_idx, dtype=np.int32)
    if _want_cpp(use_cpp):
        return _index_helpers_cpp.build_sample_idx(
            sizes, doc_idx, int(seq_length), int(num_epochs), int(tokens_per_epoch)
        )
    return _build_sample_idx_numpy(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)


def _build_sample_idx_numpy(
    sizes: np.ndarray,
    doc_idx: np.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
) -> np.ndarray:
    if seq_length < 1 or num_epochs < 1 or tokens_per_epoch < 1:
        raise ValueError(
            f"need seq_length, num_epochs, tokens_per_epoch >= 1, got "
            f"{seq_length}, {num_epochs}, {tokens_per_epoch}"
        )
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_idx = np.zeros((num_samples + 1, 2), dtype=np.int32)
    if num_samples == 0:
        return sample_idx
    document_ends = np.cumsum(sizes[doc_idx], dtype=np.int64)
    if document_ends.size == 0 or document_ends[-1] <= num_samples * seq_length:
        raise ValueError(
            "doc_idx holds fewer tokens than num_epochs * tokens_per_epoch "
            f"({int(document_ends[-1]) if document_ends.size else 0} < "
            f"{num_epochs * tokens_per_epoch})"
        )
    # Sample boundaries sit on tokens k * seq_length; each lands in the document that contains
    # that token, which skips empty documents exactly as Megatron's walk does. Row 0 stays (0, 0)
    # even when the first document is empty: the walk starts there before skipping anything.
    positions = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length
    doc_positions = np.searchsorted(document_ends, positions, side="right")
    document_starts = document_ends[doc_positions] - sizes[doc_idx[doc_positions]]
    sample_idx[1:, 0] = doc_positions
    sample_idx[1:, 1] = positions - document_starts
    return sample_idx


def build_shuffle_idx(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Shuffled [0, num_samples) followed by shuffled [num_samples, total_size), Megatron's order.

    uint32, or int64 when `total_size` does not fit in uint32 (same threshold as Megatron).
    """
    if not 0 <= num_samples <= total_size:
        raise ValueError(f"need 0 <= num_samples <= total_size, got {num_samples} and {total_size}")
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(0, num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


@dataclass
class GPTIndices:
    """The three arrays a GPT dataset reads through; see the module docstring."""

    doc_idx: np.ndarray
    sample_idx: np.ndarray
    shuffle_idx: np.ndarray
    plan: EpochPlan


def build_gpt_indices(
    documents: np.ndarray,
    sizes: np.ndarray,
    num_samples: int,
    seq_length: int,
    seed: int,
    use_cpp: bool | None = None,
) -> GPTIndices:
    """Build `doc_idx`, `sample_idx` and `shuffle_idx` exactly as Megatron's GPTDataset does.

    `documents` are the sequence ids of one split, `sizes` the token count of every sequence
    of the indexed dataset. One `RandomState(seed)` drives both shuffles, in Megatron's order.
    """
    documents = np.asarray(documents)
    sizes = np.asarray(sizes)
    if documents.size == 0:
        raise ValueError("documents is empty: a split with no documents has no samples")
    if documents.min() < 0 or documents.max() >= sizes.shape[0]:
        raise ValueError(
            f"documents must lie in [0, {sizes.shape[0]}), got range "
            f"[{documents.min()}, {documents.max()}]"
        )
    tokens_per_epoch = int(np.sum(sizes[documents], dtype=np.int64))
    if tokens_per_epoch == 0:
        raise ValueError(f"the {documents.size} documents hold no tokens; cannot build samples")
    plan = plan_epochs(tokens_per_epoch, seq_length, num_samples)
    rng = np.random.RandomState(seed=seed)
    doc_idx = build_doc_idx(documents, plan.num_epochs, rng, plan.separate_last_epoch)
    sample_idx = build_sample_idx(
        sizes, doc_idx, seq_length, plan.num_epochs, tokens_per_epoch, use_cpp=use_cpp
    )
    total_samples = sample_idx.shape[0] - 1
    first_block = (
        plan.num_samples_from_epochs_minus_one if plan.separate_last_epoch else total_samples
    )
    shuffle_idx = build_shuffle_idx(first_block, total_samples, rng)
    return GPTIndices(doc_idx, sample_idx, shuffle_idx, plan)


def build_blending_indices(
    weights: Sequence[float], size: int, use_cpp: bool | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Which dataset (uint8) and which of its samples (int64) each blended sample reads.

    Greedy, as Megatron's helper: sample i goes to the dataset with the largest
    `weight * max(i, 1) - samples_drawn`, ties to the lowest index. `weights` should sum to 1.
    """
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    if not 1 <= weights.size <= 255:
        raise ValueError(f"blending needs 1 to 255 datasets, got {weights.size}")
    if size < 0:
        raise ValueError(f"blended size must be >= 0, got {size}")
    if _want_cpp(use_cpp):
        return _index_helpers_cpp.build_blending_indices(weights, int(size))
    return _build_blending_indices_python(weights, size)


def _build_blending_indices_python(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    # The greedy choice depends on every earlier one, so this is a loop; plain Python floats
    # are IEEE doubles, giving the same comparisons as the C++ code.
    weight_list = [float(weight) for weight in weights]
    dataset_range = range(1, len(weight_list))
    drawn = [0] * len(weight_list)
    dataset_index = np.empty(size, dtype=np.uint8)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    chosen_list = [0] * size
    sample_list = [0] * size
    for sample in range(size):
        progress = max(float(sample), 1.0)
        best = 0
        best_error = weight_list[0] * progress - drawn[0]
        for dataset in dataset_range:
            error = weight_list[dataset] * progress - drawn[dataset]
            if error > best_error:
                best_error = error
                best = dataset
        chosen_list[sample] = best
        sample_list[sample] = drawn[best]
        drawn[best] += 1
    dataset_index[:] = chosen_list
    dataset_sample_index[:] = sample_list
    return dataset_index, dataset_sample_index
