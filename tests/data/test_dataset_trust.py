"""pretrain_gpt.py end to end: the index cache says what it does, bad datasets stop with one line."""

import numpy as np
import pytest

import pretrain_gpt
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
from tests.sample_data import copy_dataset
from tests.tiny_gpt import run_expecting_error, tiny_gpt_args

SPLIT_NAMES = ("train", "valid", "test")


@pytest.fixture
def fresh_prefix(sample_prefix, tmp_path):
    """The sample dataset in a directory of its own, so no index cache exists yet."""
    return copy_dataset(sample_prefix, str(tmp_path / "owt_text_document"))


def run_args(prefix, *extra):
    return tiny_gpt_args(prefix, *extra, train_iters=3)


def index_lines(output: str) -> list:
    return [line for line in output.splitlines() if " indices for " in line]


def write_token_dataset(prefix: str, documents) -> None:
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for tokens in documents:
        builder.add_item(np.asarray(tokens, dtype=np.uint16))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def run_expecting_user_error(argv, capsys) -> str:
    """The message of the one line the entry point prints for the run's DatasetError."""
    return run_expecting_error(argv, capsys)[len("error: ") :]


def test_index_cache_is_built_reused_and_rebuilt_for_another_split(fresh_prefix, capsys):
    pretrain_gpt.main(run_args(fresh_prefix))
    built = index_lines(capsys.readouterr().out)
    assert [line.split(" indices")[0] for line in built] == [
        f" > building {name}" for name in SPLIT_NAMES
    ]
    assert built[0].startswith(
        f" > building train indices for {fresh_prefix} (cache owt_text_document_train_indexmap_"
        "24ns_64sl_1234s_"
    )
    assert (
        "no cache with this description): 949 of 1000 documents [0, 949), 24 samples" in (built[0])
    )

    pretrain_gpt.main(run_args(fresh_prefix))
    loaded = index_lines(capsys.readouterr().out)
    assert [line.split(" indices")[0] for line in loaded] == [
        f" > loading {name}" for name in SPLIT_NAMES
    ]
    assert loaded[0].startswith(f" > loading train indices for {fresh_prefix} from cache ")
    cache_name = built[0].split("(cache ")[1].split(":")[0]
    assert cache_name in loaded[0]

    pretrain_gpt.main(run_args(fresh_prefix, "--split", "50,949,1"))
    rebuilt = index_lines(capsys.readouterr().out)
    assert rebuilt[0].startswith(f" > building train indices for {fresh_prefix} (cache ")
    assert "50 of 1000 documents [0, 50)" in rebuilt[0] and cache_name not in rebuilt[0]
    print("\n".join(built + loaded + rebuilt))


def test_split_without_train_documents(sample_prefix, capsys):
    message = run_expecting_user_error(run_args(sample_prefix, "--split", "0,50,50"), capsys)
    assert message == (
        f"--split 0,50,50 gives the train split none of the 1000 documents of {sample_prefix}: "
        "there is nothing to train on; give the first --split weight a positive value"
    )


def test_dataset_without_tokens(tmp_path, capsys):
    prefix = str(tmp_path / "empty_text_document")
    write_token_dataset(prefix, [[]] * 20)
    message = run_expecting_user_error(run_args(prefix), capsys)
    assert message.startswith(f"{prefix} (train split): the 19 documents [0, 19) hold no tokens"), (
        message
    )


def test_token_ids_beyond_the_padded_vocabulary(tmp_path, capsys):
    prefix = str(tmp_path / "vocab64k_text_document")
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 64000, size=200) for _ in range(40)]
    documents[3][17] = 64000
    write_token_dataset(prefix, documents)
    message = run_expecting_user_error(run_args(prefix), capsys)
    assert message == (
        f"{prefix} (train split): token id 64000 is at or above the padded vocabulary size "
        "50304 of this run's tokenizer: the data was tokenized with another vocabulary; "
        "preprocess it with this run's --vocab-file/--merge-file (or --tokenizer-model)"
    )


@pytest.mark.parametrize("flag", ["--data-path", "--train-data-path"])
@pytest.mark.parametrize("suffix", [".bin", ".idx"])
def test_data_path_naming_a_file_gets_the_prefix_to_pass(sample_prefix, capsys, flag, suffix):
    argv = run_args(sample_prefix + suffix)
    argv[argv.index("--data-path")] = flag
    with pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        f"error: {flag} {sample_prefix}{suffix}: give the dataset prefix without {suffix}, "
        f"i.e. {flag} {sample_prefix}\n"
    )


def test_no_evaluation_needs_no_evaluation_samples(sample_prefix):
    """With --eval-iters 0 the test split (one 554-token document) holds no sample of 1024
    tokens; nothing is evaluated, so the run trains."""
    args = tiny_gpt_args(
        sample_prefix, "--seq-length", "1024", "--max-position-embeddings", "1024",
        "--eval-iters", "0", train_iters=3, micro_batch=1, global_batch=1,
    )  # fmt: skip
    result = pretrain_gpt.main(args)
    assert result.iteration == 3 and result.validation == []
