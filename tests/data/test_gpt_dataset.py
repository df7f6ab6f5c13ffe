"""GPTDataset and BlendedDataset against the raw token stream, caching, splits and blends."""

import os

import numpy as np
import pytest

from megatron.data import gpt_dataset as gpt_dataset_module
from megatron.data.blended_dataset import BlendedDataset
from megatron.data.gpt_dataset import GPTDataset, build_dataset, build_train_valid_test_datasets
from megatron.data.index_helpers import cpp_helpers_available
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from tests.data import megatron_reference as reference
from tests.launch import run_distributed

SEQ_LENGTH = 16
ARRAYS = ("doc_idx", "sample_idx", "shuffle_idx")


def write_dataset(prefix: str, seed: int, num_documents: int = 60, vocab: int = 1000) -> list:
    """Random documents (some empty) at `prefix`; returns their token arrays."""
    rng = np.random.default_rng(seed)
    documents = []
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(num_documents):
        length = 0 if rng.random() < 0.15 else int(rng.integers(1, 50))
        tokens = rng.integers(0, vocab, size=length).astype(np.uint16)
        builder.add_item(tokens)
        builder.end_document()
        documents.append(tokens.astype(np.int64))
    builder.finalize(prefix + ".idx")
    return documents


@pytest.fixture
def corpus(tmp_path):
    prefix = str(tmp_path / "corpus_text_document")
    return prefix, write_dataset(prefix, seed=0)


def expected_sample(dataset: GPTDataset, documents: list, index: int) -> np.ndarray:
    """Sample `index` cut directly from the document stream in doc_idx order."""
    stream = np.concatenate([documents[doc] for doc in dataset.doc_idx])
    start = int(dataset.shuffle_idx[index]) * SEQ_LENGTH
    return stream[start : start + SEQ_LENGTH + 1]


@pytest.mark.parametrize("num_samples", [10, 150])  # one epoch; several with a separate last one
def test_samples_are_slices_of_the_token_stream(corpus, num_samples):
    prefix, documents = corpus
    indexed = MMapIndexedDataset(prefix)
    dataset = GPTDataset(
        "train", prefix, np.arange(5, 50, dtype=np.int32), indexed, num_samples, SEQ_LENGTH, 1234
    )
    assert len(dataset) >= num_samples
    for index in range(len(dataset)):
        sample = dataset[index]["text"]
        assert sample.dtype == np.int64 and sample.shape == (SEQ_LENGTH + 1,)
        np.testing.assert_array_equal(sample, expected_sample(dataset, documents, index))
    assert set(dataset.doc_idx.tolist()) <= set(range(5, 50))
    with pytest.raises(IndexError):
        dataset[len(dataset)]


def test_index_cache_is_written_once_and_reloaded(corpus, monkeypatch):
    prefix, _ = corpus
    indexed = MMapIndexedDataset(prefix)
    documents = np.arange(len(indexed), dtype=np.int32)
    first = GPTDataset("valid", prefix, documents, indexed, 40, SEQ_LENGTH, 5)
    paths = first.index_paths
    stem = f"{prefix}_valid_indexmap_40ns_{SEQ_LENGTH}sl_5s_{first.description_hash}"
    assert paths["doc_idx"] == f"{stem}_doc_idx.npy"
    assert all(os.path.isfile(path) for path in paths.values())
    assert not [name for name in os.listdir(os.path.dirname(prefix)) if name.endswith(".tmp")]

    def must_not_rebuild(*args, **kwargs):
        raise AssertionError("indices were rebuilt although the cache exists")

    monkeypatch.setattr(gpt_dataset_module, "build_gpt_indices", must_not_rebuild)
    second = GPTDataset("valid", prefix, documents, indexed, 40, SEQ_LENGTH, 5)
    assert isinstance(second.shuffle_idx, np.memmap)
    for name in ("doc_idx", "sample_idx", "shuffle_idx"):
        np.testing.assert_array_equal(getattr(first, name), getattr(second, name))
    assert [second[i]["text"].tolist() for i in range(len(second))] == [
        first[i]["text"].tolist() for i in range(len(first))
    ]


@pytest.mark.skipif(not cpp_helpers_available(), reason="C++ helpers not built")
def test_cpp_and_numpy_datasets_write_identical_files(tmp_path):
    cached = {}
    for use_cpp in (True, False):
        prefix = str(tmp_path / f"cpp{use_cpp}")
        write_dataset(prefix, seed=3)
        indexed = MMapIndexedDataset(prefix)
        dataset = GPTDataset(
            "train", prefix, np.arange(len(indexed), dtype=np.int32), indexed, 120, 8, 9, use_cpp
        )
        cached[use_cpp] = [open(dataset.index_paths[name], "rb").read() for name in ARRAYS]
    assert cached[True] == cached[False]


def test_split_datasets_use_their_document_ranges(corpus):
    prefix, documents = corpus
    train, valid, test = build_train_valid_test_datasets(
        [prefix], "80,15,5", [50, 20, 10], SEQ_LENGTH, 1
    )
    boundaries = reference.split_boundaries("80,15,5", len(documents))
    for index, dataset in enumerate((train, valid, test)):
        assert set(dataset.doc_idx.tolist()) <= set(range(boundaries[index], boundaries[index + 1]))
        assert len(dataset) >= [50, 20, 10][index]
    # The test split is a handful of documents, so it repeats: samples still match the stream.
    for index in range(len(test)):
        np.testing.assert_array_equal(test[index]["text"], expected_sample(test, documents, index))
    assert build_train_valid_test_datasets([prefix], "100,0,0", [5, 5, 5], SEQ_LENGTH, 1)[1:] == (
        None,
        None,
    )


def test_blended_datasets_follow_megatron(tmp_path):
    prefixes = [str(tmp_path / "a"), str(tmp_path / "b")]
    write_dataset(prefixes[0], seed=1)
    write_dataset(prefixes[1], seed=2, num_documents=90)
    requested = [300, 40, 20]
    train, valid, test = build_train_valid_test_datasets(
        ["0.3", prefixes[0], "0.7", prefixes[1]], "80,15,5", requested, SEQ_LENGTH, 42
    )
    for dataset, count in zip((train, valid, test), requested):
        assert isinstance(dataset, BlendedDataset)
        per_dataset = reference.blended_counts([0.3, 0.7], count)
        assert len(dataset) == sum(per_dataset)  # Megatron sizes a blend by the inflated counts
        assert [len(part) >= need for part, need in zip(dataset.datasets, per_dataset)] == [
            True,
            True,
        ]
        chosen, within = reference.blending_indices([0.3, 0.7], len(dataset))
        assert dataset.dataset_index.tolist() == chosen
        assert dataset.dataset_sample_index.tolist() == within
    assert np.bincount(train.dataset_index) / len(train) == pytest.approx([0.3, 0.7], abs=0.01)
    for index in range(0, len(train), 7):
        part = train.datasets[train.dataset_index[index]]
        np.testing.assert_array_equal(
            train[index]["text"], part[int(train.dataset_sample_index[index])]["text"]
        )
    # Each blended part caches under its own prefix with its own (inflated) sample count.
    part_paths = train.datasets[0].index_paths
    assert part_paths["doc_idx"].startswith(
        f"{prefixes[0]}_train_indexmap_91ns_{SEQ_LENGTH}sl_42s_"
    )
    assert os.path.isfile(part_paths["doc_idx"])


def test_separate_split_paths_use_all_documents(tmp_path):
    a, b, c = (str(tmp_path / name) for name in "abc")
    for seed, prefix in enumerate((a, b, c)):
        write_dataset(prefix, seed=seed, num_documents=20)
    train, valid, test = build_train_valid_test_datasets(
        None,
        "949,50,1",
        [30, 10, 5],
        SEQ_LENGTH,
        3,
        train_data_path=["1", a, "3", b],
        valid_data_path=[c],
    )
    assert isinstance(train, BlendedDataset) and test is None
    assert sorted(set(valid.doc_idx.tolist())) == list(range(20))
    assert valid.index_paths["sample_idx"].startswith(f"{c}_valid_indexmap_10ns_{SEQ_LENGTH}sl_3s_")
    assert os.path.isfile(valid.index_paths["sample_idx"])
    single = build_dataset("test", [c], 5, SEQ_LENGTH, 3)
    assert len(single) >= 5


def test_data_errors_name_the_value(tmp_path, corpus):
    prefix, _ = corpus
    with pytest.raises(ValueError, match="has 3 entries"):
        build_train_valid_test_datasets(["0.5", prefix, "0.5"], "1", [1, 1, 1], SEQ_LENGTH, 1)
    with pytest.raises(ValueError, match="--valid-data-path"):
        build_train_valid_test_datasets(
            None, "1", [1, 1, 1], SEQ_LENGTH, 1, valid_data_path=["x", prefix]
        )
    with pytest.raises(ValueError, match="no data"):
        build_train_valid_test_datasets(None, "1", [1, 1, 1], SEQ_LENGTH, 1)
    tiny = str(tmp_path / "tiny")
    write_dataset(tiny, seed=5, num_documents=3)
    # "98,2,0" gives the 3-document dataset no valid documents, the 60-document one some.
    with pytest.raises(ValueError, match="valid split none of the 3 documents of .*tiny"):
        build_train_valid_test_datasets(
            ["1", prefix, "1", tiny], "98,2,0", [4, 4, 0], SEQ_LENGTH, 1
        )
    empty = str(tmp_path / "empty")
    builder = MMapIndexedDatasetBuilder(empty + ".bin")
    builder.add_item(np.array([], dtype=np.uint16))
    builder.end_document()
    builder.finalize(empty + ".idx")
    with pytest.raises(ValueError, match="empty.*no tokens"):
        build_dataset("train", [empty], 4, SEQ_LENGTH, 1)


def _two_rank_worker(rank: int, world_size: int, prefix: str) -> np.ndarray:
    if rank == 1:

        def must_not_build(*args, **kwargs):
            raise AssertionError("rank 1 built indices")

        gpt_dataset_module.build_gpt_indices = must_not_build
    train, _, _ = build_train_valid_test_datasets([prefix], "90,10,0", [64, 8, 0], SEQ_LENGTH, 11)
    return np.stack([train[i]["text"] for i in range(len(train))])


def test_only_rank_zero_builds_and_all_ranks_agree(corpus):
    prefix, _ = corpus
    samples = run_distributed(_two_rank_worker, 2, prefix)
    np.testing.assert_array_equal(samples[0], samples[1])
