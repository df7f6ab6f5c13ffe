"""tools/merge_datasets.py: prefixes and directories in, one dataset out, errors named."""

import numpy as np

from megatron.data import merge_datasets
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder


def _write(prefix, documents):
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for document in documents:
        builder.add_item(np.array(document, dtype=np.uint16))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


def test_merges_prefixes_and_directories_in_order(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    _write(shards / "b", [[7, 8], [9]])
    _write(shards / "a", [[4, 5, 6]])
    _write(tmp_path / "first", [[1, 2], [3]])
    output = tmp_path / "merged"
    assert (
        merge_datasets.main(
            ["--input", str(tmp_path / "first"), str(shards), "--output-prefix", str(output)]
        )
        == 0
    )
    merged = MMapIndexedDataset(str(output))
    assert [merged.get(i).tolist() for i in range(len(merged))] == [
        [1, 2],
        [3],
        [4, 5, 6],
        [7, 8],
        [9],
    ]
    assert merged.doc_idx.tolist() == [0, 1, 2, 3, 4, 5]
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "first.bin", "first.idx", "merged.bin", "merged.idx", "shards",
    ]  # fmt: skip


def test_bad_inputs_are_named(tmp_path, capsys):
    assert (
        merge_datasets.main(
            ["--input", str(tmp_path / "nope"), "--output-prefix", str(tmp_path / "out")]
        )
        == 1
    )
    assert "nope: neither a directory nor a dataset prefix" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert (
        merge_datasets.main(
            ["--input", str(tmp_path / "empty"), "--output-prefix", str(tmp_path / "out")]
        )
        == 1
    )
    assert "the directory holds no .idx/.bin pairs" in capsys.readouterr().err
    _write(tmp_path / "same", [[1]])
    args = ["--input", str(tmp_path / "same"), "--output-prefix", str(tmp_path / "same")]
    assert merge_datasets.main(args) == 1
    assert "is also an input" in capsys.readouterr().err
