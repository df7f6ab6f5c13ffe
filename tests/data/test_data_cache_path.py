"""--data-cache-path (megatron/data/index_cache.py): the index caches in a directory of their
own, so a read-only dataset directory serves; without it, one line saying what to do."""

from __future__ import annotations

import os

import numpy as np
import pytest

from megatron.data import gpt_dataset as gpt_dataset_module
from megatron.data.errors import DatasetError
from megatron.data.gpt_dataset import build_train_valid_test_datasets
from tests.data.read_only import read_only
from tests.data.test_gpt_dataset import SEQ_LENGTH, write_dataset


@pytest.fixture
def prefix(tmp_path):
    (tmp_path / "data").mkdir()
    prefix = str(tmp_path / "data" / "corpus_text_document")
    write_dataset(prefix, seed=0)  # 60 documents
    return prefix


def build(prefix, **kwargs):
    return build_train_valid_test_datasets([prefix], "80,15,5", [50, 8, 0], SEQ_LENGTH, 1, **kwargs)


def test_caches_go_to_the_cache_path_of_a_read_only_dataset(prefix, tmp_path, monkeypatch):
    data_dir, cache_dir = os.path.dirname(prefix), tmp_path / "cache" / "nested"
    beside = build(prefix)[0]  # caches beside the data, for the samples to compare with
    before = sorted(os.listdir(data_dir))
    with read_only(tmp_path / "data", monkeypatch):
        train, valid, _ = build(prefix, cache_path=str(cache_dir))
        for dataset in (train, valid):
            for path in dataset.index_paths.values():
                assert os.path.dirname(path) == str(cache_dir) and os.path.isfile(path)
        # Another rank reads the one cache global rank 0 wrote, building nothing.
        monkeypatch.setattr(gpt_dataset_module, "_is_global_rank_zero", lambda: False)
        monkeypatch.setattr(gpt_dataset_module, "build_gpt_indices", _must_not_rebuild)
        other_rank_train, _, _ = build(prefix, cache_path=str(cache_dir))
    assert sorted(os.listdir(data_dir)) == before  # nothing beside the data
    assert len(os.listdir(cache_dir)) == 12  # 3 splits x (3 arrays + description)
    assert other_rank_train.index_paths == train.index_paths
    for index in range(len(train)):
        np.testing.assert_array_equal(other_rank_train[index]["text"], beside[index]["text"])


def test_read_only_dataset_without_cache_path_is_one_line(prefix, tmp_path, monkeypatch):
    with read_only(tmp_path / "data", monkeypatch), pytest.raises(DatasetError) as raised:
        build(prefix)
    data_dir = os.path.dirname(prefix)
    assert str(raised.value).startswith(f"{prefix} (train split): cannot write the index cache ")
    assert str(raised.value).endswith(
        f" beside the data in {data_dir} (Permission denied): give --data-cache-path DIR, a "
        "directory global rank 0 can write and every rank can read"
    )
    assert "\n" not in str(raised.value)


def test_unwritable_cache_path_is_named(prefix, tmp_path, monkeypatch):
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    with read_only(cache_dir, monkeypatch), pytest.raises(DatasetError) as raised:
        build(prefix, cache_path=str(cache_dir))
    assert f"into --data-cache-path {cache_dir} (Permission denied)" in str(raised.value)


def _must_not_rebuild(*args, **kwargs):
    raise AssertionError("indices were rebuilt although global rank 0 wrote them")
