"""Datasets that cannot serve a run stop with one DatasetError line naming the dataset and fix."""

import numpy as np
import pytest

from megatron.data.errors import DatasetError, check_datasets_serve_run
from megatron.data.gpt_dataset import GPTDataset, build_dataset, build_train_valid_test_datasets
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from megatron.errors import UserError
from tests.data.test_gpt_dataset import SEQ_LENGTH, write_dataset


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message and isinstance(error.value, UserError)
    return message


def write_token_dataset(prefix: str, documents, dtype=np.uint16) -> None:
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for tokens in documents:
        builder.add_item(np.asarray(tokens, dtype=dtype))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def test_documents_without_tokens(tmp_path):
    prefix = str(tmp_path / "empty_text_document")
    write_token_dataset(prefix, [[]] * 5)
    with pytest.raises(DatasetError) as error:
        build_train_valid_test_datasets([prefix], "80,20,0", [8, 2, 0], SEQ_LENGTH, 1)
    message = one_line(error)
    assert message.startswith(f"{prefix} (train split): the 4 documents [0, 4) hold no tokens")
    with pytest.raises(DatasetError, match="hold no tokens"):
        build_dataset("valid", [prefix], 4, SEQ_LENGTH, 1)


def test_token_ids_beyond_the_vocabulary(tmp_path):
    prefix = str(tmp_path / "big_vocab_text_document")
    write_token_dataset(prefix, [[5, 64000, 7, 8] * 10, [1, 2, 3] * 10, [63999] * 20])
    # 64000 lies in the train split's documents, 63999 in the valid split's.
    with pytest.raises(DatasetError) as error:
        build_train_valid_test_datasets(
            [prefix], "2,1,0", [8, 4, 0], SEQ_LENGTH, 1, vocab_size=50304
        )
    assert one_line(error) == (
        f"{prefix} (train split): token id 64000 is at or above the padded vocabulary size "
        "50304 of this run's tokenizer: the data was tokenized with another vocabulary; "
        "preprocess it with this run's --vocab-file/--merge-file (or --tokenizer-model)"
    )
    # The largest id comes from the cache's description file when the cache is reused.
    train, valid, _ = build_train_valid_test_datasets(
        [prefix], "2,1,0", [8, 4, 0], SEQ_LENGTH, 1, vocab_size=64001
    )
    assert (train.max_token_id, valid.max_token_id) == (64000, 63999)
    with pytest.raises(DatasetError, match="token id 64000 .* size 64000 "):
        build_train_valid_test_datasets(
            [prefix], "2,1,0", [8, 4, 0], SEQ_LENGTH, 1, vocab_size=64000
        )


def test_blend_member_without_documents_in_a_split(tmp_path):
    big, tiny = str(tmp_path / "big"), str(tmp_path / "tiny")
    write_dataset(big, seed=1)
    write_dataset(tiny, seed=2, num_documents=3)
    with pytest.raises(DatasetError) as error:
        build_train_valid_test_datasets(["1", big, "1", tiny], "98,2,0", [4, 4, 0], SEQ_LENGTH, 1)
    message = one_line(error)
    assert "valid split" in message and tiny in message and "--split" in message


def test_missing_dataset_files_are_dataset_errors(tmp_path):
    with pytest.raises(DatasetError, match=r"index file .*nothing\.idx does not exist"):
        build_train_valid_test_datasets([str(tmp_path / "nothing")], "1", [4, 0, 0], SEQ_LENGTH, 1)


def datasets_for(prefix, split, counts=(16, 4, 4)):
    return build_train_valid_test_datasets([prefix], split, list(counts), SEQ_LENGTH, 1)


def test_split_that_gives_train_no_documents(tmp_path):
    prefix = str(tmp_path / "corpus")
    write_dataset(prefix, seed=0)
    datasets = datasets_for(prefix, "0,50,50")
    with pytest.raises(DatasetError) as error:
        check_datasets_serve_run(datasets, [prefix], "0,50,50", global_batch_size=8)
    assert one_line(error) == (
        f"--split 0,50,50 gives the train split none of the 60 documents of {prefix}: there is "
        "nothing to train on; give the first --split weight a positive value"
    )
    # A positive weight that rounds to no documents asks for a larger share instead.
    datasets = datasets_for(prefix, "1,200,0")
    with pytest.raises(DatasetError, match="none of the 60 documents .* larger share"):
        check_datasets_serve_run(datasets, [prefix], "1,200,0", global_batch_size=8)


def test_run_without_train_data_path(tmp_path):
    prefix = str(tmp_path / "corpus")
    write_dataset(prefix, seed=0)
    datasets = build_train_valid_test_datasets(
        None, "1", [0, 4, 0], SEQ_LENGTH, 1, valid_data_path=[prefix]
    )
    with pytest.raises(DatasetError, match="no --train-data-path"):
        check_datasets_serve_run(datasets, None, "969,30,1", global_batch_size=8)


def test_train_split_smaller_than_one_global_batch(tmp_path):
    prefix = str(tmp_path / "short")
    write_token_dataset(prefix, [[1] * 40, [2] * 40])
    datasets = datasets_for(prefix, "1,0,0", counts=(2, 0, 0))
    assert len(datasets[0]) < 8
    with pytest.raises(DatasetError) as error:
        check_datasets_serve_run(datasets, [prefix], "1,0,0", global_batch_size=8)
    message = one_line(error)
    assert message.startswith(f"{prefix} (train split): {len(datasets[0])} samples")
    assert "one global batch of 8" in message
    check_datasets_serve_run(datasets, [prefix], "1,0,0", global_batch_size=2)


def test_dataset_errors_are_value_errors(tmp_path):
    prefix = str(tmp_path / "corpus")
    write_dataset(prefix, seed=0)
    with pytest.raises(ValueError, match="no documents"):
        GPTDataset(
            "train", prefix, np.zeros(0, np.int32), MMapIndexedDataset(prefix), 4, SEQ_LENGTH, 1
        )
