"""Plain-Python, loop-by-loop restatement of Megatron-LM's legacy index algorithms.

Written for the tests from the algorithm's description, deliberately without numpy tricks,
so the fast builders in megatron/data/index_helpers.py are checked against something simple.
"""

from __future__ import annotations

import math

import numpy as np


def split_boundaries(split: str, num_documents: int) -> list[int]:
    separator = "," if "," in split else "/"
    weights = [float(part) for part in split.split(separator)]
    while len(weights) < 3:
        weights.append(0.0)
    total = sum(weights)
    boundaries = [0]
    for weight in weights:
        boundaries.append(boundaries[-1] + int(round(weight / total * float(num_documents))))
    surplus = boundaries[-1] - num_documents
    return [boundaries[0]] + [boundary - surplus for boundary in boundaries[1:]]


def num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    epochs, tokens = 0, 0
    while True:
        epochs += 1
        tokens += tokens_per_epoch
        if (tokens - 1) // seq_length >= num_samples:
            return epochs


def shuffled_epochs(documents, epochs: int, rng: np.random.RandomState) -> list[int]:
    order = np.array([doc for _ in range(epochs) for doc in documents], dtype=np.int32)
    rng.shuffle(order)
    return order.tolist()


def sample_starts(sizes, doc_idx, seq_length: int, epochs: int, tokens_per_epoch: int) -> list:
    num_samples = (epochs * tokens_per_epoch - 1) // seq_length
    rows = [(0, 0)]
    position, offset = 0, 0
    while len(rows) <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            length = sizes[doc_idx[position]] - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                position += 1
                offset = 0
        rows.append((position, offset))
    return rows


def shuffled_range(start: int, stop: int, rng: np.random.RandomState) -> list[int]:
    values = np.array(list(range(start, stop)), dtype=np.uint32)
    rng.shuffle(values)
    return values.tolist()


def gpt_indices(documents, sizes, num_samples: int, seq_length: int, seed: int):
    """(doc_idx, sample_idx rows, shuffle_idx, separate_last_epoch) as Megatron builds them."""
    sizes = [int(size) for size in sizes]
    documents = [int(doc) for doc in documents]
    tokens_per_epoch = sum(sizes[doc] for doc in documents)
    epochs = num_epochs(tokens_per_epoch, seq_length, num_samples)
    separate = False
    from_epochs_minus_one = 0
    if epochs > 1:
        from_epochs_minus_one = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate = (num_samples - from_epochs_minus_one) < int(0.80 * per_epoch)
    rng = np.random.RandomState(seed)
    if separate:
        doc_idx = shuffled_epochs(documents, epochs - 1, rng) + shuffled_epochs(documents, 1, rng)
    else:
        doc_idx = shuffled_epochs(documents, epochs, rng)
    rows = sample_starts(sizes, doc_idx, seq_length, epochs, tokens_per_epoch)
    total = len(rows) - 1
    first = from_epochs_minus_one if separate else total
    shuffle = shuffled_range(0, first, rng)
    if first != total:
        shuffle += shuffled_range(first, total, rng)
    return doc_idx, rows, shuffle, separate


def blending_indices(weights, size: int):
    """(dataset per sample, sample within that dataset) by the greedy max-error rule."""
    # Megatron normalizes twice: when parsing --data-path, then in BlendableDataset (np.sum).
    total = sum(weights)
    weights = np.array([weight / total for weight in weights], dtype=np.float64)
    weights = (weights / np.sum(weights)).tolist()
    drawn = [0] * len(weights)
    chosen, within = [], []
    for sample in range(size):
        errors = [weight * max(sample, 1) - count for weight, count in zip(weights, drawn)]
        best = errors.index(max(errors))  # first maximum: ties go to the lowest index
        chosen.append(best)
        within.append(drawn[best])
        drawn[best] += 1
    return chosen, within


def blended_counts(weights, num_samples: int) -> list[int]:
    total = sum(weights)
    return [int(math.ceil(num_samples * weight / total * 1.005)) for weight in weights]
