"""Megatron's mmap indexed dataset: the `.bin`/`.idx` pair that preprocessing writes and training reads.

Byte layout of `PREFIX.idx` (little-endian), identical to Megatron-LM's `MMapIndexedDataset`:

    magic            9 bytes   b"MMIDIDX\\x00\\x00"
    version          uint64    1
    dtype code       uint8     see DTYPE_CODES
    sequence count   uint64    N
    document count   uint64    D  (entries of the document index, = documents + 1)
    sizes            int32 x N     tokens per sequence
    pointers         int64 x N     byte offset of each sequence in PREFIX.bin
    document index   int64 x D     sequence index where each document starts, then N

`PREFIX.bin` holds the token ids of all sequences back to back in that dtype.
"""

from __future__ import annotations

import os
import shutil
import struct
from typing import Iterable, Optional, Sequence, Union

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER_SIZE = len(INDEX_MAGIC) + 8 + 1 + 8 + 8

# Megatron's code table (megatron/core/datasets/indexed_dataset.py DType).
DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF_DTYPE = {np.dtype(dtype): code for code, dtype in DTYPE_CODES.items()}


class IndexedDatasetError(ValueError):
    """A `.bin`/`.idx` pair is missing, damaged, or does not match the format."""


def index_file_path(prefix: str) -> str:
    """Path of the index file for a dataset prefix."""
    return prefix + ".idx"


def data_file_path(prefix: str) -> str:
    """Path of the token file for a dataset prefix."""
    return prefix + ".bin"


def best_fitting_dtype(vocab_size: Optional[int]) -> type:
    """Token dtype Megatron picks: uint16 below 65,500 tokens, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def dtype_code(dtype) -> int:
    """Megatron's one-byte code for a numpy dtype."""
    try:
        return _CODE_OF_DTYPE[np.dtype(dtype)]
    except KeyError:
        raise IndexedDatasetError(
            f"dtype {np.dtype(dtype)} has no code in Megatron's indexed-dataset table "
            f"(supported: {', '.join(str(np.dtype(d)) for d in DTYPE_CODES.values())})"
        ) from None


def write_index(
    path: str,
    dtype,
    sizes: Union[Sequence[int], np.ndarray],
    doc_idx: Union[Sequence[int], np.ndarray],
) -> None:
    """Write an index file for sequences of `sizes` tokens grouped into documents by `doc_idx`."""
    sizes = np.asarray(sizes, dtype=np.int32)
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    with open(path, "wb") as index_file:
        index_file.write(INDEX_MAGIC)
        index_file.write(struct.pack("<Q", INDEX_VERSION))
        index_file.write(struct.pack("<B", dtype_code(dtype)))
        index_file.write(struct.pack("<Q", len(sizes)))
        index_file.write(struct.pack("<Q", len(doc_idx)))
        index_file.write(sizes.tobytes(order="C"))
        index_file.write(pointers.tobytes(order="C"))
        index_file.write(doc_idx.tobytes(order="C"))


class MMapIndexedDatasetBuilder:
    """Appends sequences to a `.bin` file and writes the matching `.idx` at `finalize`.

    The caller decides where the files go; `megatron.data.preprocess` points it at temporary
    names and renames them once both are complete.
    """

    def __init__(self, bin_path: str, dtype=np.uint16):
        self._dtype = np.dtype(dtype)
        dtype_code(self._dtype)  # reject dtypes Megatron cannot name, before writing anything
        self._bin_path = bin_path
        self._data_file = open(bin_path, "wb")
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    def add_item(self, tokens: Union[np.ndarray, Sequence[int]]) -> None:
        """Append one sequence (a sentence, or a whole document)."""
        array = np.asarray(tokens)
        if array.dtype != self._dtype:
            array = array.astype(self._dtype)
        self._data_file.write(array.tobytes(order="C"))
        self._sizes.append(array.size)

    def add_items(self, flat_tokens: np.ndarray, lengths: Iterable[int]) -> None:
        """Append several sequences given as one flat array and their lengths (one write)."""
        array = np.asarray(flat_tokens)
        if array.dtype != self._dtype:
            array = array.astype(self._dtype)
        self._data_file.write(array.tobytes(order="C"))
        self._sizes.extend(int(length) for length in lengths)

    def end_document(self) -> None:
        """Close the current document: its sequences are those added since the last call."""
        self._doc_idx.append(len(self._sizes))

    def end_documents(self, sequences_per_document: Iterable[int]) -> None:
        """Close several documents at once, given how many of the added sequences each holds."""
        position = self._doc_idx[-1]
        for count in sequences_per_document:
            position += int(count)
            self._doc_idx.append(position)
        if position != len(self._sizes):
            raise ValueError(
                f"documents cover {position} sequences but {len(self._sizes)} were added"
            )

    def add_document(
        self, tokens: Union[np.ndarray, Sequence[int]], lengths: Sequence[int]
    ) -> None:
        """Append a document made of sequences of `lengths` tokens (Megatron-core's API)."""
        self.add_items(np.asarray(tokens), lengths)
        self.end_document()

    def merge_file_(self, prefix: str) -> None:
        """Append every sequence and document of the dataset at `prefix`."""
        other = MMapIndexedDataset(prefix)
        if other.dtype != self._dtype:
            raise IndexedDatasetError(
                f"cannot merge {index_file_path(prefix)}: its dtype is {other.dtype}, "
                f"the output's is {self._dtype}"
            )
        offset = len(self._sizes)
        self._sizes.extend(other.sizes.tolist())
        self._doc_idx.extend((offset + other.doc_idx[1:]).tolist())
        del other
        with open(data_file_path(prefix), "rb") as source:
            shutil.copyfileobj(source, self._data_file, 16 * 1024 * 1024)

    def finalize(self, idx_path: str, fsync: bool = True) -> None:
        """Flush the token file and write the index file."""
        self._data_file.flush()
        if fsync:
            os.fsync(self._data_file.fileno())
        self._data_file.close()
        write_index(idx_path, self._dtype, self._sizes, self._doc_idx)
        if fsync:
            with open(idx_path, "rb") as index_file:
                os.fsync(index_file.fileno())

    def abandon(self) -> None:
        """Close and delete the partial token file (used when preprocessing fails)."""
        if not self._data_file.closed:
            self._data_file.close()
        if os.path.exists(self._bin_path):
            os.remove(self._bin_path)


class _Index:
    """The parsed `.idx` file; arrays are views into a read-only memory map."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise IndexedDatasetError(f"index file {path} does not exist")
        file_size = os.path.getsize(path)
        if file_size < _HEADER_SIZE:
            raise IndexedDatasetError(
                f"index file {path} is {file_size} bytes, shorter than the {_HEADER_SIZE}-byte header"
            )
        with open(path, "rb") as index_file:
            magic = index_file.read(len(INDEX_MAGIC))
            if magic != INDEX_MAGIC:
                raise IndexedDatasetError(
                    f"index file {path} starts with {magic!r}, not Megatron's mmap magic "
                    f"{INDEX_MAGIC!r}: it is not a Megatron mmap indexed dataset (--dataset-impl mmap)"
                )
            (version,) = struct.unpack("<Q", index_file.read(8))
            if version != INDEX_VERSION:
                raise IndexedDatasetError(
                    f"index file {path} has version {version}; only version {INDEX_VERSION} is supported"
                )
            (code,) = struct.unpack("<B", index_file.read(1))
            if code not in DTYPE_CODES:
                raise IndexedDatasetError(
                    f"index file {path} has dtype code {code}; known codes are {sorted(DTYPE_CODES)}"
                )
            self.dtype = np.dtype(DTYPE_CODES[code])
            (self.sequence_count,) = struct.unpack("<Q", index_file.read(8))
            (self.document_count,) = struct.unpack("<Q", index_file.read(8))

        expected = _HEADER_SIZE + self.sequence_count * (4 + 8) + self.document_count * 8
        if file_size != expected:
            raise IndexedDatasetError(
                f"index file {path} is {file_size} bytes but its header describes "
                f"{self.sequence_count} sequences and {self.document_count} document entries "
                f"({expected} bytes): the file is truncated or damaged"
            )
        buffer = np.memmap(path, mode="r", dtype=np.uint8)
        offset = _HEADER_SIZE
        self.sizes = np.frombuffer(buffer, np.int32, self.sequence_count, offset)
        offset += self.sizes.nbytes
        self.pointers = np.frombuffer(buffer, np.int64, self.sequence_count, offset)
        offset += self.pointers.nbytes
        self.doc_idx = np.frombuffer(buffer, np.int64, self.document_count, offset)
        self._buffer = buffer


class MMapIndexedDataset:
    """Read-only view of a Megatron mmap indexed dataset at `prefix` (.idx + .bin).

    Opening checks the magic, version, dtype code and that both files have exactly the
    sizes the header promises, so a truncated or mismatched pair fails here, by name.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._index = _Index(index_file_path(prefix))
        bin_path = data_file_path(prefix)
        if not os.path.isfile(bin_path):
            raise IndexedDatasetError(
                f"token file {bin_path} does not exist (index {prefix}.idx does)"
            )
        expected_bytes = int(self._index.sizes.sum(dtype=np.int64)) * self._index.dtype.itemsize
        actual_bytes = os.path.getsize(bin_path)
        if actual_bytes != expected_bytes:
            raise IndexedDatasetError(
                f"token file {bin_path} is {actual_bytes} bytes but {index_file_path(prefix)} "
                f"describes {expected_bytes} bytes: the pair is truncated or from different runs"
            )
        self._tokens = (
            np.memmap(bin_path, mode="r", dtype=self._index.dtype)
            if expected_bytes
            else np.zeros(0, self._index.dtype)
        )

    def __len__(self) -> int:
        return int(self._index.sequence_count)

    @property
    def dtype(self) -> np.dtype:
        return self._index.dtype

    @property
    def sizes(self) -> np.ndarray:
        """Tokens per sequence (int32)."""
        return self._index.sizes

    @property
    def pointers(self) -> np.ndarray:
        """Byte offset of each sequence in the .bin file (int64)."""
        return self._index.pointers

    @property
    def doc_idx(self) -> np.ndarray:
        """Sequence index where each document starts, followed by the sequence count (int64)."""
        return self._index.doc_idx

    def get(self, index: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens `offset .. offset+length` of sequence `index` (to its end if length is None)."""
        if not 0 <= index < len(self):
            raise IndexError(
                f"sequence {index} out of range for {self.prefix} ({len(self)} sequences)"
            )
        size = int(self._index.sizes[index])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"tokens {offset}..{offset + length} out of range for sequence {index} "
                f"of {self.prefix} ({size} tokens)"
            )
        start = int(self._index.pointers[index]) // self._index.dtype.itemsize + offset
        return np.array(self._tokens[start : start + length])

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def __iter__(self):
        for index in range(len(self)):
            yield self.get(index)


def dataset_exists(prefix: str) -> bool:
    """True when both files of the dataset at `prefix` are present."""
    return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))
