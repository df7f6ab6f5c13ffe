"""Synthetic GPT samples for `--mock-data`: throughput runs without a corpus.

The tokens have the shape of Megatron-Core's `MockGPTDataset` (megatron/core/datasets/
gpt_dataset.py there): documents of a random length L in [1, 4096), each the ramp 1, 2, ...,
L - 1 (modulo the tokenizer's vocabulary) closed by the end-of-document token, and samples of
`seq_length + 1` tokens cut from their stream. Megatron-Core draws 100,000 document lengths
from a fixed seed and runs its usual index building over them; here each sample draws its own
documents, and where in the first one it starts, from a generator seeded by (--seed, split,
sample index). So sample i is the same on every rank and in every run, no index arrays are
built or cached, and the train, validation and test streams differ.
"""

from __future__ import annotations

import numpy as np
import torch

# Megatron-Core's bound: document lengths are drawn from [1, MAX_DOCUMENT_LENGTH).
MAX_DOCUMENT_LENGTH = 4096


class MockGPTDataset(torch.utils.data.Dataset):
    """`num_samples` synthetic samples of `seq_length + 1` tokens ({"text": int64 array}),
    each a function of (`seed`, `split_index`, sample index) only; token ids stay below
    `vocab_size`, `eod` among them."""

    def __init__(
        self,
        name: str,
        split_index: int,
        num_samples: int,
        seq_length: int,
        seed: int,
        vocab_size: int,
        eod: int,
    ) -> None:
        if not 0 <= eod < vocab_size:
            raise ValueError(
                f"the end-of-document id {eod} is not below the vocabulary {vocab_size}"
            )
        self.name = name
        self.data_prefix = f"mock data ({name} split)"  # what dataset messages name
        self.split_index = split_index
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.seed = seed
        self.vocab_size = vocab_size
        self.eod = eod

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict:
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {self.name} ({len(self)} samples)")
        idx %= len(self)
        generator = np.random.default_rng([self.seed, self.split_index, idx])
        wanted = self.seq_length + 1
        pieces, held = [], 0
        while held < wanted:
            length = int(generator.integers(1, MAX_DOCUMENT_LENGTH))
            document = np.empty(length, dtype=np.int64)
            document[:-1] = np.arange(1, length) % self.vocab_size
            document[-1] = self.eod
            if not pieces:  # the sample starts anywhere in its first document
                document = document[int(generator.integers(0, length)) :]
            pieces.append(document)
            held += document.size
        return {"text": np.concatenate(pieces)[:wanted]}
