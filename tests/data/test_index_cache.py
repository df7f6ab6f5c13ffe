"""The sample-index cache: keyed on everything that determines the arrays, never loaded damaged."""

import json
import os

import numpy as np
import pytest

from megatron.data import gpt_dataset as gpt_dataset_module
from megatron.data import index_cache as index_cache_module
from megatron.data.errors import DatasetError
from megatron.data.gpt_dataset import GPTDataset, build_train_valid_test_datasets
from megatron.data.index_helpers import build_gpt_indices
from megatron.data.indexed_dataset import MMapIndexedDataset
from tests.data import megatron_reference as reference
from tests.data.test_gpt_dataset import SEQ_LENGTH, expected_sample, write_dataset

ARRAYS = ("doc_idx", "sample_idx", "shuffle_idx")


@pytest.fixture
def prefix(tmp_path):
    prefix = str(tmp_path / "corpus_text_document")
    write_dataset(prefix, seed=0)  # 60 documents
    return prefix


def build_train(prefix, split="80,15,5", num_samples=50, seed=1, **kwargs):
    train, _, _ = build_train_valid_test_datasets(
        [prefix], split, [num_samples, 0, 0], SEQ_LENGTH, seed, **kwargs
    )
    return train


def train_log_line(output: str) -> str:
    lines = [line for line in output.splitlines() if " train indices for " in line]
    assert len(lines) == 1, output
    return lines[0]


def file_identity(path):
    status = os.stat(path)
    return status.st_ino, status.st_mtime_ns, status.st_size


def must_not_rebuild(*args, **kwargs):
    raise AssertionError("indices were rebuilt although a usable cache exists")


def test_changing_split_rebuilds_with_the_new_train_range(prefix, capsys):
    first = build_train(prefix, "80,15,5")
    capsys.readouterr()
    second = build_train(prefix, "20,75,5")
    train_end = reference.split_boundaries("20,75,5", 60)[1]
    # The old cache (keyed on samples, length and seed only) held documents of [0, 48).
    assert set(second.doc_idx.tolist()) <= set(range(train_end))
    line = train_log_line(capsys.readouterr().out)
    assert line.startswith(f" > building train indices for {prefix} (cache ")
    assert f"{train_end} of 60 documents [0, {train_end})" in line
    assert second.index_paths["doc_idx"] != first.index_paths["doc_idx"]


def test_recreated_dataset_with_more_documents_is_used(prefix, capsys):
    build_train(prefix, "100,0,0")
    documents = write_dataset(prefix, seed=7, num_documents=120)
    capsys.readouterr()
    dataset = build_train(prefix, "100,0,0")
    assert max(dataset.doc_idx.tolist()) >= 60, "the new documents are never read"
    assert set(dataset.doc_idx.tolist()) <= set(range(120))
    for index in range(len(dataset)):
        np.testing.assert_array_equal(
            dataset[index]["text"], expected_sample(dataset, documents, index)
        )
    assert train_log_line(capsys.readouterr().out).startswith(" > building train indices")


def test_recreated_dataset_with_fewer_documents_is_rebuilt(prefix, capsys):
    build_train(prefix, "100,0,0")
    documents = write_dataset(prefix, seed=7, num_documents=30)
    capsys.readouterr()
    dataset = build_train(prefix, "100,0,0")
    assert set(dataset.doc_idx.tolist()) <= set(range(30))
    for index in range(len(dataset)):  # the stale cache gave an IndexError here
        np.testing.assert_array_equal(
            dataset[index]["text"], expected_sample(dataset, documents, index)
        )
    assert train_log_line(capsys.readouterr().out).startswith(" > building train indices")


def test_changing_the_seed_rebuilds(prefix, capsys):
    first = build_train(prefix, seed=1)
    capsys.readouterr()
    second = build_train(prefix, seed=2)
    assert train_log_line(capsys.readouterr().out).startswith(" > building train indices")
    assert second.index_paths["doc_idx"] != first.index_paths["doc_idx"]
    assert first.doc_idx.tolist() != second.doc_idx.tolist()


def test_identical_settings_load_the_cache_without_rewriting_it(prefix, capsys, monkeypatch):
    first = build_train(prefix)
    capsys.readouterr()
    before = {name: file_identity(path) for name, path in first.index_paths.items()}
    monkeypatch.setattr(gpt_dataset_module, "build_gpt_indices", must_not_rebuild)
    second = build_train(prefix)
    line = train_log_line(capsys.readouterr().out)
    assert line.startswith(f" > loading train indices for {prefix} from cache ")
    assert second.description_hash in line
    assert {name: file_identity(path) for name, path in second.index_paths.items()} == before
    assert isinstance(second.shuffle_idx, np.memmap)
    for name in ARRAYS:
        np.testing.assert_array_equal(getattr(first, name), getattr(second, name))


def test_cache_files_keep_megatrons_stem_and_add_the_hash(prefix):
    dataset = build_train(prefix, num_samples=40, seed=5)
    digest = dataset.description_hash
    stem = f"{prefix}_train_indexmap_40ns_{SEQ_LENGTH}sl_5s_{digest}"
    assert dataset.index_paths == {
        "doc_idx": f"{stem}_doc_idx.npy",
        "sample_idx": f"{stem}_sample_idx.npy",
        "shuffle_idx": f"{stem}_shuffle_idx.npy",
        "description": f"{stem}_description.json",
    }
    assert not [name for name in os.listdir(os.path.dirname(prefix)) if ".tmp" in name]


def test_description_names_what_determines_the_arrays(prefix):
    dataset = build_train(prefix, "80,15,5", num_samples=40, seed=5)
    with open(dataset.index_paths["description"]) as file:
        record = json.load(file)
    description = record["description"]
    indexed = MMapIndexedDataset(prefix)
    assert description["class"] == "GPTDataset"
    assert description["split_name"] == "train"
    assert description["split"] == pytest.approx([0.8, 0.15, 0.05])
    assert description["documents"] == {"start": 0, "stop": 48}
    assert (description["num_samples"], description["seq_length"], description["seed"]) == (
        40,
        SEQ_LENGTH,
        5,
    )
    assert description["separate_last_epoch_threshold"] == 0.8
    assert isinstance(description["separate_last_epoch"], bool)
    assert description["blend"] is None
    assert description["indexed_dataset"]["bin_bytes"] == os.path.getsize(prefix + ".bin")
    assert description["indexed_dataset"]["idx_bytes"] == os.path.getsize(prefix + ".idx")
    assert len(description["indexed_dataset"]["idx_sha256"]) == 64
    assert record["description_hash"] == dataset.description_hash
    assert record["max_token_id"] == max(
        int(indexed.get(doc).max()) for doc in range(48) if indexed.sizes[doc]
    )
    plan = record["epoch_plan"]
    assert plan["num_epochs"] >= 1 and plan["tokens_per_epoch"] == int(indexed.sizes[:48].sum())


def test_blend_and_separate_paths_are_described(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_dataset(a, seed=1)
    write_dataset(b, seed=2)
    train, _, _ = build_train_valid_test_datasets(
        ["0.25", a, "0.75", b], "80,20,0", [40, 10, 0], SEQ_LENGTH, 3
    )
    with open(train.datasets[0].index_paths["description"]) as file:
        description = json.load(file)["description"]
    assert description["blend"] == {"weights": [0.25, 0.75], "prefixes": [a, b]}
    valid_only = build_train_valid_test_datasets(
        None, "1", [0, 10, 0], SEQ_LENGTH, 3, valid_data_path=[a]
    )[1]
    with open(valid_only.index_paths["description"]) as file:
        description = json.load(file)["description"]
    assert description["split"] is None and description["documents"] == {"start": 0, "stop": 60}


def test_documents_that_are_not_a_range_are_hashed(prefix):
    indexed = MMapIndexedDataset(prefix)
    documents = np.array([9, 3, 4, 5, 20, 21, 40], dtype=np.int32)
    dataset = GPTDataset("train", prefix, documents, indexed, 30, SEQ_LENGTH, 1)
    with open(dataset.index_paths["description"]) as file:
        record = json.load(file)
    assert record["description"]["documents"]["count"] == 7
    assert len(record["description"]["documents"]["sha256"]) == 64
    assert record["max_token_id"] == max(
        int(indexed.get(doc).max()) for doc in documents if indexed.sizes[doc]
    )
    other = GPTDataset("train", prefix, documents[:-1], indexed, 30, SEQ_LENGTH, 1)
    assert other.description_hash != dataset.description_hash


def test_largest_token_id_is_found_in_bounded_chunks(prefix, monkeypatch):
    monkeypatch.setattr(index_cache_module, "TOKENS_PER_CHUNK", 7)
    indexed = MMapIndexedDataset(prefix)
    documents = np.arange(10, 50, dtype=np.int32)
    dataset = GPTDataset("train", prefix, documents, indexed, 30, SEQ_LENGTH, 1)
    expected = max(int(indexed.get(doc).max()) for doc in documents if indexed.sizes[doc])
    assert dataset.max_token_id == expected


@pytest.mark.parametrize("damage", ["half", "header", "empty", "missing"])
@pytest.mark.parametrize("array", ARRAYS)
def test_damaged_array_is_rebuilt(prefix, capsys, array, damage):
    first = build_train(prefix)
    expected = {name: np.array(getattr(first, name)) for name in ARRAYS}
    path = first.index_paths[array]
    size = os.path.getsize(path)
    del first
    if damage == "missing":
        os.remove(path)
    else:
        with open(path, "r+b") as file:
            file.truncate({"half": size // 2, "header": 10, "empty": 0}[damage])
    capsys.readouterr()
    second = build_train(prefix)
    line = train_log_line(capsys.readouterr().out)
    assert line.startswith(" > building train indices") and array in line, line
    for name in ARRAYS:
        np.testing.assert_array_equal(getattr(second, name), expected[name])
    assert os.path.getsize(path) == size


def test_arrays_from_another_cache_are_rebuilt(prefix, capsys):
    first = build_train(prefix, num_samples=50)
    other = build_train(prefix, num_samples=400)
    os.replace(other.index_paths["sample_idx"], first.index_paths["sample_idx"])
    capsys.readouterr()
    second = build_train(prefix, num_samples=50)
    assert train_log_line(capsys.readouterr().out).startswith(" > building train indices")
    assert len(second.shuffle_idx) == len(second.sample_idx) - 1


@pytest.mark.parametrize("damage", ["half", "garbled", "not_an_object", "other", "missing"])
def test_damaged_description_is_rebuilt(prefix, capsys, damage):
    first = build_train(prefix)
    path = first.index_paths["description"]
    text = open(path).read()
    if damage == "missing":  # arrays written, then the build was interrupted
        os.remove(path)
    else:
        record = json.loads(text)
        record["description"]["seed"] = 99
        replacement = {
            "half": text[: len(text) // 2],
            "garbled": "\x00not json{",
            "not_an_object": "[1, 2]",
            "other": json.dumps(record),
        }[damage]
        with open(path, "w") as file:
            file.write(replacement)
    capsys.readouterr()
    second = build_train(prefix)
    assert train_log_line(capsys.readouterr().out).startswith(" > building train indices")
    assert json.loads(open(path).read()) == json.loads(text)
    np.testing.assert_array_equal(second.doc_idx, first.doc_idx)


def test_arrays_are_committed_before_the_description(prefix, monkeypatch):
    replaced = []
    real_replace = os.replace

    def recording_replace(source, destination):
        replaced.append(os.path.basename(destination))
        real_replace(source, destination)

    monkeypatch.setattr(index_cache_module.os, "replace", recording_replace)
    dataset = build_train(prefix, "100,0,0")
    assert replaced == [os.path.basename(dataset.index_paths[name]) for name in ARRAYS] + [
        os.path.basename(dataset.index_paths["description"])
    ]


def test_cached_arrays_are_megatrons_arrays(prefix):
    dataset = build_train(prefix, "100,0,0", num_samples=150, seed=9, use_cpp=False)
    indexed = MMapIndexedDataset(prefix)
    built = build_gpt_indices(
        np.arange(60, dtype=np.int32), indexed.sizes, 150, SEQ_LENGTH, 9, use_cpp=False
    )
    for name in ARRAYS:
        on_disk = np.load(dataset.index_paths[name])
        assert on_disk.dtype == getattr(built, name).dtype
        np.testing.assert_array_equal(on_disk, getattr(built, name))


def test_other_ranks_refuse_an_unusable_cache(prefix, monkeypatch):
    monkeypatch.setattr(gpt_dataset_module, "_is_global_rank_zero", lambda: False)
    with pytest.raises(DatasetError, match=r"rank 0 .*shared") as error:
        build_train(prefix)
    assert prefix in str(error.value) and "\n" not in str(error.value)
