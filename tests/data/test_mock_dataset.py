"""megatron/data/mock_dataset.py: synthetic samples shaped like Megatron-Core's mock documents,
a function of (seed, split, index) only."""

from __future__ import annotations

import numpy as np
import pytest

from megatron.data.mock_dataset import MAX_DOCUMENT_LENGTH, MockGPTDataset

EOD = 50256


def mock(split_index=0, num_samples=64, seq_length=512, seed=1234, vocab_size=50257, eod=EOD):
    return MockGPTDataset("train", split_index, num_samples, seq_length, seed, vocab_size, eod)


def test_samples_are_a_function_of_seed_split_and_index():
    first, again = mock(), mock()
    assert len(first) == 64
    for index in (0, 5, 63, -1):
        assert np.array_equal(first[index]["text"], again[index]["text"])
    assert np.array_equal(first[-1]["text"], first[63]["text"])
    assert not np.array_equal(first[0]["text"], first[1]["text"])
    assert not np.array_equal(first[0]["text"], mock(split_index=1)[0]["text"])
    assert not np.array_equal(first[0]["text"], mock(seed=1)[0]["text"])
    with pytest.raises(IndexError, match="sample 64 out of range"):
        first[64]


def test_documents_are_ramps_closed_by_the_end_of_document_token():
    dataset = mock(seq_length=4 * MAX_DOCUMENT_LENGTH)
    for index in range(8):
        text = dataset[index]["text"]
        assert text.dtype == np.int64 and text.shape == (4 * MAX_DOCUMENT_LENGTH + 1,)
        ends = np.flatnonzero(text == EOD)
        assert ends.size >= 2  # 4 maximal documents' worth of tokens spans several
        # Between two end-of-document tokens: 1, 2, ..., L - 1 with L < MAX_DOCUMENT_LENGTH.
        for start, stop in zip(ends[:-1] + 1, ends[1:]):
            assert np.array_equal(text[start:stop], np.arange(1, stop - start + 1))
            assert stop - start + 1 < MAX_DOCUMENT_LENGTH


def test_token_ids_stay_below_a_small_vocabulary():
    dataset = mock(vocab_size=100, seq_length=2048, eod=0)
    text = np.concatenate([dataset[index]["text"] for index in range(16)])
    assert text.min() >= 0 and text.max() < 100


def test_end_of_document_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="end-of-document id 50256 is not below the vocabulary 64"):
        mock(vocab_size=64)
