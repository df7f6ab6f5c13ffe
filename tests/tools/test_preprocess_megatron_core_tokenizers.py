"""tools/preprocess_data.py with Megatron-Core's other tokenizer types: each writes a readable
dataset of the ids Megatron-Core gives (computed without this project's tokenizers), and each
bad flag or text stops it with one line, before any output."""

from __future__ import annotations

import json
import lzma
import os
from pathlib import Path

import pytest
import sentencepiece

from megatron.data import dataset_info, preprocess
from megatron.data.indexed_dataset import MMapIndexedDataset
from tests.sample_data import CORPUS
from tests.tokenizer.tiktoken_vocabulary import (
    PATTERN_V1,
    MegatronCoreTikTokenOracle,
    write_gpt2_tiktoken_vocabulary,
)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    with lzma.open(CORPUS, "rt", encoding="utf-8") as handle:
        return [json.loads(line)["text"][:2000] for _, line in zip(range(8), handle)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, texts) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return path


def _preprocess(corpus: Path, prefix: Path, *tokenizer_flags: str) -> int:
    return preprocess.main(
        ["--input", str(corpus), "--output-prefix", str(prefix), "--append-eod"]
        + ["--workers", "1", *tokenizer_flags]
    )


def _documents(prefix: Path) -> list[list[int]]:
    dataset = MMapIndexedDataset(f"{prefix}_text_document")
    return [dataset.get(index).tolist() for index in range(len(dataset))]


def _error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, lines
    return lines[0]


def test_the_three_sentencepiece_names_write_the_same_dataset(tmp_path, corpus, texts):
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=200,
        model_type="bpe",
        num_threads=1,
        minloglevel=2,
    )
    model = str(tmp_path / "sp.model")
    processor = sentencepiece.SentencePieceProcessor(model_file=model)
    written = {}
    for name in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        prefix = tmp_path / name
        assert (
            _preprocess(corpus, prefix, "--tokenizer-type", name, "--tokenizer-model", model) == 0
        )
        written[name] = Path(f"{prefix}_text_document.bin").read_bytes()
        # Megatron-Core: the model's encoding, then --append-eod's EOS; no BOS for any name.
        expected = [processor.encode_as_ids(text) + [processor.eos_id()] for text in texts]
        assert _documents(prefix) == expected
    assert len(set(written.values())) == 1


def test_tiktokenizer_writes_megatron_cores_ids(tmp_path, corpus, texts):
    vocabulary = tmp_path / "gpt2-tiktoken.json"
    write_gpt2_tiktoken_vocabulary(vocabulary)
    flags = ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(vocabulary)]
    flags += ["--tiktoken-pattern", "v1", "--vocab-size", "51256"]
    assert _preprocess(corpus, tmp_path / "tik", *flags) == 0
    oracle = MegatronCoreTikTokenOracle(PATTERN_V1, vocab_size=51256)
    assert _documents(tmp_path / "tik") == [oracle.encode(text) + [2] for text in texts]


def test_null_tokenizer_writes_the_ids_of_the_text(tmp_path):
    source = tmp_path / "ids.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["5 6 7", "0", "98 1"]))
    flags = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    assert _preprocess(source, tmp_path / "null", *flags) == 0
    assert _documents(tmp_path / "null") == [[5, 6, 7, 99], [0, 99], [98, 1, 99]]


def test_dataset_info_shows_a_null_tokenizer_sample_as_its_ids(tmp_path, capsys):
    source = tmp_path / "ids.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["5 6 7", "0", "98 1 3"]))
    flags = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    assert _preprocess(source, tmp_path / "null", *flags) == 0
    info = [
        "--data-path",
        f"{tmp_path}/null_text_document",
        "--seq-length",
        "4",
        "--split",
        "1,0,0",
    ]
    info += ["--train-samples", "2", "--valid-samples", "0", "--test-samples", "0"]
    capsys.readouterr()
    assert dataset_info.main(info + flags) == 0
    (preview,) = [line for line in capsys.readouterr().out.splitlines() if "starts:" in line]
    shown = preview.split("'")[1].split(" ")  # seq-length + 1 ids of the shuffled stream
    assert len(shown) == 5 and set(shown) <= {"5", "6", "7", "0", "98", "1", "3", "99"}
    assert dataset_info.main(info + flags[:2]) == 1
    assert _error_line(capsys).startswith(
        "error: --tokenizer-type NullTokenizer needs --vocab-size"
    )


def test_null_tokenizer_text_that_is_not_ids_stops_naming_the_lines(tmp_path, capsys):
    source = tmp_path / "words.jsonl"
    source.write_text(json.dumps({"text": "5 6"}) + "\n" + json.dumps({"text": "five"}) + "\n")
    flags = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    assert _preprocess(source, tmp_path / "null", *flags) == 1
    assert _error_line(capsys) == (
        f"error: {source}, lines 1-2, key 'text': --tokenizer-type NullTokenizer reads a text as "
        "integer ids separated by single spaces, and 'five' is not one; give such text or "
        "choose another --tokenizer-type"
    )
    assert not [name for name in os.listdir(tmp_path) if name.startswith("null")]


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            ["--tokenizer-type", "NullTokenizer"],
            "error: --tokenizer-type NullTokenizer needs --vocab-size N (its ids are 0..N-1, the "
            "last one ends each document); none was given",
        ),
        (
            ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "org/model"],
            "error: --tokenizer-model org/model is not a local file or directory, and this "
            "project does not download tokenizers (no network): get a local copy with "
            "`huggingface-cli download org/model --local-dir DIR` and pass --tokenizer-model DIR",
        ),
    ],
)
def test_a_bad_tokenizer_flag_is_one_line_before_any_output(tmp_path, corpus, capsys, flags, line):
    assert _preprocess(corpus, tmp_path / "out", *flags) == 1
    assert _error_line(capsys) == line
    assert os.listdir(tmp_path) == []
