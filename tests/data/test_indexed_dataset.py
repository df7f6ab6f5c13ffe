"""Writer -> reader round trips and the exact on-disk bytes of Megatron's mmap format."""

import struct

import numpy as np
import pytest

from megatron.data.indexed_dataset import (
    DTYPE_CODES,
    IndexedDatasetError,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    best_fitting_dtype,
)


def _write_random(prefix, dtype, rng, documents=7, max_sequences=4, max_len=50):
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    sequences, doc_idx = [], [0]
    info = np.iinfo(dtype) if np.issubdtype(dtype, np.integer) else None
    for _ in range(documents):
        for _ in range(rng.integers(1, max_sequences + 1)):
            length = int(rng.integers(0, max_len))
            if info is not None:
                values = rng.integers(
                    info.min, info.max, size=length, endpoint=True, dtype=np.int64
                )
                sequence = values.astype(dtype)
            else:
                sequence = rng.standard_normal(length).astype(dtype)
            builder.add_item(sequence)
            sequences.append(sequence)
        builder.end_document()
        doc_idx.append(len(sequences))
    builder.finalize(prefix + ".idx")
    return sequences, doc_idx


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_round_trip_every_dtype(tmp_path, code):
    dtype = DTYPE_CODES[code]
    rng = np.random.default_rng(code)
    prefix = str(tmp_path / f"ds{code}")
    sequences, doc_idx = _write_random(prefix, dtype, rng)

    dataset = MMapIndexedDataset(prefix)
    assert dataset.dtype == np.dtype(dtype)
    assert len(dataset) == len(sequences)
    np.testing.assert_array_equal(dataset.sizes, [len(s) for s in sequences])
    np.testing.assert_array_equal(dataset.doc_idx, doc_idx)
    for index, sequence in enumerate(sequences):
        np.testing.assert_array_equal(dataset.get(index), sequence)
        if len(sequence) >= 3:
            np.testing.assert_array_equal(dataset.get(index, offset=1, length=2), sequence[1:3])
            np.testing.assert_array_equal(dataset.get(index, offset=2), sequence[2:])
    with pytest.raises(IndexError):
        dataset.get(len(sequences))


def test_index_bytes_match_megatron_layout(tmp_path):
    """Pack the expected .idx by hand from the format description and compare byte for byte."""
    prefix = str(tmp_path / "exact")
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.add_item(np.array([1, 2, 3], dtype=np.uint16))
    builder.add_item(np.array([4], dtype=np.uint16))
    builder.end_document()
    builder.add_item(np.array([5, 6], dtype=np.uint16))
    builder.end_document()
    builder.finalize(prefix + ".idx")

    expected = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
    expected += struct.pack("<Q", 3) + struct.pack("<Q", 3)
    expected += struct.pack("<3i", 3, 1, 2)
    expected += struct.pack("<3q", 0, 6, 8)
    expected += struct.pack("<3q", 0, 2, 3)
    with open(prefix + ".idx", "rb") as index_file:
        assert index_file.read() == expected
    with open(prefix + ".bin", "rb") as data_file:
        assert data_file.read() == struct.pack("<6H", 1, 2, 3, 4, 5, 6)


def test_best_fitting_dtype_follows_megatron():
    assert best_fitting_dtype(50257) == np.uint16
    assert best_fitting_dtype(65499) == np.uint16
    assert best_fitting_dtype(65500) == np.int32
    assert best_fitting_dtype(128256) == np.int32
    assert best_fitting_dtype(None) == np.int32


def test_builder_rejects_unknown_dtype(tmp_path):
    with pytest.raises(IndexedDatasetError, match="uint32"):
        MMapIndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint32)


@pytest.fixture
def small_dataset(tmp_path):
    prefix = str(tmp_path / "small")
    _write_random(prefix, np.uint16, np.random.default_rng(0))
    return prefix


def _patch(path, offset, data):
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)


def test_bad_magic_is_named(small_dataset):
    _patch(small_dataset + ".idx", 0, b"TNTIDX\x00\x00\x00")
    with pytest.raises(IndexedDatasetError, match=r"small\.idx.*magic"):
        MMapIndexedDataset(small_dataset)


def test_bad_version_is_named(small_dataset):
    _patch(small_dataset + ".idx", 9, struct.pack("<Q", 2))
    with pytest.raises(IndexedDatasetError, match=r"small\.idx has version 2"):
        MMapIndexedDataset(small_dataset)


def test_bad_dtype_code_is_named(small_dataset):
    _patch(small_dataset + ".idx", 17, struct.pack("<B", 9))
    with pytest.raises(IndexedDatasetError, match=r"dtype code 9"):
        MMapIndexedDataset(small_dataset)


def test_truncated_index_is_named(small_dataset):
    with open(small_dataset + ".idx", "r+b") as handle:
        handle.truncate(40)
    with pytest.raises(IndexedDatasetError, match=r"small\.idx is 40 bytes.*truncated"):
        MMapIndexedDataset(small_dataset)


def test_truncated_bin_is_named(small_dataset):
    with open(small_dataset + ".bin", "r+b") as handle:
        size = handle.seek(0, 2)
        handle.truncate(size - 2)
    with pytest.raises(IndexedDatasetError, match=r"small\.bin is \d+ bytes but"):
        MMapIndexedDataset(small_dataset)


def test_missing_files_are_named(tmp_path, small_dataset):
    import os

    with pytest.raises(IndexedDatasetError, match=r"nothing\.idx does not exist"):
        MMapIndexedDataset(str(tmp_path / "nothing"))
    os.remove(small_dataset + ".bin")
    with pytest.raises(IndexedDatasetError, match=r"small\.bin does not exist"):
        MMapIndexedDataset(small_dataset)


def test_merge_concatenates_documents(tmp_path):
    rng = np.random.default_rng(3)
    first, first_docs = _write_random(str(tmp_path / "a"), np.uint16, rng, documents=4)
    second, second_docs = _write_random(str(tmp_path / "b"), np.uint16, rng, documents=3)
    builder = MMapIndexedDatasetBuilder(str(tmp_path / "merged.bin"), dtype=np.uint16)
    builder.merge_file_(str(tmp_path / "a"))
    builder.merge_file_(str(tmp_path / "b"))
    builder.finalize(str(tmp_path / "merged.idx"))

    merged = MMapIndexedDataset(str(tmp_path / "merged"))
    assert len(merged) == len(first) + len(second)
    np.testing.assert_array_equal(
        merged.doc_idx, first_docs + [len(first) + d for d in second_docs[1:]]
    )
    for index, sequence in enumerate(first + second):
        np.testing.assert_array_equal(merged.get(index), sequence)


def test_merge_rejects_mixed_dtypes(tmp_path):
    rng = np.random.default_rng(4)
    _write_random(str(tmp_path / "wide"), np.int32, rng)
    builder = MMapIndexedDatasetBuilder(str(tmp_path / "out.bin"), dtype=np.uint16)
    with pytest.raises(IndexedDatasetError, match=r"wide\.idx: its dtype is int32"):
        builder.merge_file_(str(tmp_path / "wide"))
