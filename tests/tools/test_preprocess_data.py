"""tools/preprocess_data.py on the real sample corpus, and on every kind of bad input."""

import gzip
import json
import lzma
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import sentencepiece

from megatron.data import preprocess
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.tokenizer import build_tokenizer
from tests.sample_data import CORPUS, EOD, MERGES, REPO, VOCAB
from tests.sample_data import gpt2_preprocess_args as _gpt2_args


def _documents():
    with lzma.open(CORPUS, "rt", encoding="utf-8") as corpus:
        return [json.loads(line)["text"] for line in corpus]


@pytest.fixture(scope="module")
def sample_outputs(tmp_path_factory):
    """The sample corpus preprocessed with 1 and with 2 workers."""
    directory = tmp_path_factory.mktemp("preprocess")
    outputs = {}
    for workers in (1, 2):
        prefix = directory / f"owt_w{workers}"
        assert preprocess.main(_gpt2_args(CORPUS, prefix, workers=workers)) == 0
        outputs[workers] = Path(f"{prefix}_text_document")
    return outputs


def test_sample_corpus_gives_1000_documents_ending_in_eod(sample_outputs):
    dataset = MMapIndexedDataset(str(sample_outputs[2]))
    assert dataset.dtype == np.uint16
    assert len(dataset) == 1000
    assert len(dataset.doc_idx) == 1001
    for index in range(len(dataset)):
        assert dataset.get(index)[-1] == EOD


def test_token_ids_equal_the_tokenizer(sample_outputs):
    dataset = MMapIndexedDataset(str(sample_outputs[2]))
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=str(VOCAB), merge_file=str(MERGES))
    for index, text in enumerate(_documents()):
        np.testing.assert_array_equal(dataset.get(index), tokenizer.tokenize(text) + [EOD])


def test_worker_counts_write_identical_files(sample_outputs):
    for suffix in (".bin", ".idx"):
        one = Path(str(sample_outputs[1]) + suffix).read_bytes()
        two = Path(str(sample_outputs[2]) + suffix).read_bytes()
        assert one == two


def _write_lines(path, lines):
    opener = (
        gzip.open if str(path).endswith(".gz") else lzma.open if str(path).endswith(".xz") else open
    )
    with opener(path, "wb") as handle:
        for line in lines:
            handle.write(line if isinstance(line, bytes) else line.encode("utf-8"))
    return path


GOOD = [
    json.dumps({"id": i, "text": f"Document number {i}. It has two sentences."}) + "\n"
    for i in range(5)
]


def _assert_no_outputs(prefix):
    leftovers = [
        name
        for name in os.listdir(os.path.dirname(prefix))
        if name.startswith(os.path.basename(prefix))
    ]
    assert leftovers == [], leftovers


@pytest.mark.parametrize(
    "bad_line, message",
    [
        (b'{"id": 9, "text": "unterminated\n', r"malformed JSON"),
        (b'{"id": 9, "body": "no text key"}\n', r"key 'text' is missing \(keys present: body, id"),
        (b'{"id": 9, "text": 42}\n', r"value of 'text' is a JSON number, not a string"),
        (b'{"id": 9, "text": "caf\xe9"}\n', r"invalid UTF-8 at byte 22"),
        (b"[1, 2]\n", r"expected a JSON object"),
    ],
)
def test_bad_line_stops_naming_file_and_line(tmp_path, capsys, bad_line, message):
    source = _write_lines(tmp_path / "bad.jsonl", [*GOOD[:3], bad_line, *GOOD[3:]])
    prefix = tmp_path / "out" / "bad"
    assert preprocess.main(_gpt2_args(source, prefix)) == 1
    error = capsys.readouterr().err
    assert f"{source}:4:" in error
    assert __import__("re").search(message, error), error
    _assert_no_outputs(str(prefix))


def test_skip_invalid_reports_count_and_lines(tmp_path, capsys):
    lines = [*GOOD[:2], b"not json\n", GOOD[2], b'{"text": null}\n', *GOOD[3:]]
    source = _write_lines(tmp_path / "mixed.jsonl.gz", lines)
    prefix = tmp_path / "mixed"
    assert preprocess.main(_gpt2_args(source, prefix, "--skip-invalid")) == 0
    error = capsys.readouterr().err
    assert "Skipped 2 invalid lines" in error
    assert f"{source}:3: malformed JSON" in error
    assert f"{source}:5: the value of 'text' is a JSON null" in error
    assert len(MMapIndexedDataset(f"{prefix}_text_document")) == 5


# Valid JSON whose string holds a lone UTF-16 surrogate: Python decodes it, no tokenizer encodes it.
LONE_SURROGATE = json.dumps({"id": 9, "text": "abc \ud800 def"}) + "\n"
# A surrogate pair is one character (an emoji here) and must still be accepted.
SURROGATE_PAIR = json.dumps({"id": 8, "text": "smile \U0001f600"}) + "\n"


@pytest.mark.parametrize("bad_key", ["text", "title"])
def test_lone_surrogate_stops_naming_file_line_and_key(tmp_path, capsys, bad_key):
    lines = [json.dumps({"text": f"body {i}", "title": f"title {i}"}) + "\n" for i in range(5)]
    lines[1] = json.dumps({"text": "smile \U0001f600", "title": "pair"}) + "\n"
    lines[3] = json.dumps({"text": "body 3", "title": "title 3", bad_key: "abc \ud800 def"}) + "\n"
    source = _write_lines(tmp_path / "surrogate.jsonl", lines)
    prefix = tmp_path / "out" / "surrogate"
    assert preprocess.main(_gpt2_args(source, prefix, "--json-keys", "text", "title")) == 1
    error = capsys.readouterr().err
    assert [line for line in error.splitlines() if line.startswith("error:")] == [
        f"error: {source}:4: the value of '{bad_key}' holds a lone surrogate \\ud800 at character 4,"
        " which is not valid Unicode text; fix or drop the line"
        " (pass --skip-invalid to skip such lines)"
    ], error
    assert "Traceback" not in error
    _assert_no_outputs(str(prefix))


@pytest.fixture(scope="module")
def tokenizer_flags(tmp_path_factory):
    """--tokenizer-type and its files for every type: GPT-2, its tokenizer.json, a tiny SentencePiece."""
    directory = tmp_path_factory.mktemp("tokenizers")
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=str(VOCAB), merge_file=str(MERGES))
    gpt2.hf_tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(json.loads(line)["text"] for line in [*GOOD, SURROGATE_PAIR]),
        model_prefix=str(directory / "tiny"),
        vocab_size=60,
        hard_vocab_limit=False,
        model_type="bpe",
        num_threads=1,
        minloglevel=2,
    )
    gpt2_files = ["--vocab-file", str(VOCAB), "--merge-file", str(MERGES)]
    return {
        "GPT2BPETokenizer": gpt2_files,
        "HuggingFaceTokenizer": ["--tokenizer-model", str(directory)],
        "SentencePieceTokenizer": ["--tokenizer-model", str(directory / "tiny.model")],
    }


@pytest.mark.parametrize(
    "tokenizer_type", ["GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer"]
)
def test_skip_invalid_skips_lone_surrogate_line_only(
    tmp_path, capsys, tokenizer_flags, tokenizer_type
):
    def run_tool(source, prefix, *extra):
        return preprocess.main(
            ["--input", str(source), "--output-prefix", str(prefix), "--append-eod"]
            + ["--tokenizer-type", tokenizer_type, *tokenizer_flags[tokenizer_type]]
            + ["--workers", "2", *extra]
        )

    good = [*GOOD[:2], SURROGATE_PAIR, *GOOD[2:]]
    clean = _write_lines(tmp_path / "clean.jsonl", good)
    dirty = _write_lines(tmp_path / "dirty.jsonl", [*good[:4], LONE_SURROGATE, *good[4:]])
    assert run_tool(clean, tmp_path / "clean") == 0
    assert run_tool(dirty, tmp_path / "dirty", "--skip-invalid") == 0
    error = capsys.readouterr().err
    assert "Skipped 1 invalid lines" in error
    assert f"{dirty}:5: the value of 'text' holds a lone surrogate \\ud800 at character 4" in error
    for suffix in (".bin", ".idx"):
        written = Path(f"{tmp_path}/dirty_text_document{suffix}").read_bytes()
        assert written == Path(f"{tmp_path}/clean_text_document{suffix}").read_bytes()
    assert len(MMapIndexedDataset(f"{tmp_path}/dirty_text_document")) == len(good)


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.jsonl.gz", "blank.jsonl"])
def test_empty_input_is_an_error(tmp_path, capsys, name):
    source = _write_lines(tmp_path / name, ["\n", "  \n"] if name.startswith("blank") else [])
    prefix = tmp_path / "out" / "empty"
    assert preprocess.main(_gpt2_args(source, prefix)) == 1
    assert f"{source}: the file is empty" in capsys.readouterr().err
    _assert_no_outputs(str(prefix))


@pytest.mark.parametrize("suffix", [".jsonl.xz", ".jsonl.gz"])
def test_truncated_compressed_input_is_an_error(tmp_path, capsys, suffix):
    whole = _write_lines(tmp_path / f"whole{suffix}", GOOD * 200)
    data = whole.read_bytes()
    cut = tmp_path / f"cut{suffix}"
    cut.write_bytes(data[: len(data) // 2])
    prefix = tmp_path / "out" / "cut"
    assert preprocess.main(_gpt2_args(cut, prefix)) == 1
    assert f"{cut}: the file is truncated or corrupt after line" in capsys.readouterr().err
    _assert_no_outputs(str(prefix))


def test_missing_input_and_bad_flags(tmp_path, capsys):
    assert preprocess.main(_gpt2_args(tmp_path / "absent.jsonl", tmp_path / "x")) == 1
    assert "absent.jsonl: no such file" in capsys.readouterr().err
    assert preprocess.main(_gpt2_args(str(tmp_path / "*.jsonl"), tmp_path / "x")) == 1
    assert "the pattern matches no files" in capsys.readouterr().err
    source = _write_lines(tmp_path / "ok.jsonl", GOOD)
    args = _gpt2_args(source, tmp_path / "x")
    args[args.index("--vocab-file") + 1] = str(tmp_path / "missing-vocab.json")
    assert preprocess.main(args) == 1
    assert "--vocab-file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        preprocess.main(_gpt2_args(source, tmp_path / "x", workers=0))


def test_failed_run_keeps_previous_outputs(tmp_path):
    source = _write_lines(tmp_path / "ok.jsonl", GOOD)
    prefix = tmp_path / "keep"
    assert preprocess.main(_gpt2_args(source, prefix)) == 0
    before = {s: Path(f"{prefix}_text_document{s}").read_bytes() for s in (".bin", ".idx")}
    bad = _write_lines(tmp_path / "bad.jsonl", [*GOOD, b"{oops\n"])
    assert preprocess.main(_gpt2_args(bad, prefix)) == 1
    after = {s: Path(f"{prefix}_text_document{s}").read_bytes() for s in (".bin", ".idx")}
    assert before == after
    assert sorted(os.listdir(tmp_path)) == [
        "bad.jsonl",
        "keep_text_document.bin",
        "keep_text_document.idx",
        "ok.jsonl",
    ]


def test_glob_of_several_files_in_order(tmp_path):
    _write_lines(tmp_path / "part-b.jsonl.gz", GOOD[3:])
    _write_lines(tmp_path / "part-a.jsonl", GOOD[:3])
    prefix = tmp_path / "glob"
    assert preprocess.main(_gpt2_args(str(tmp_path / "part-*"), prefix)) == 0
    dataset = MMapIndexedDataset(f"{prefix}_text_document")
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=str(VOCAB), merge_file=str(MERGES))
    for index, line in enumerate(GOOD):
        np.testing.assert_array_equal(
            dataset.get(index), tokenizer.tokenize(json.loads(line)["text"]) + [EOD]
        )


def test_empty_documents_dropped_or_kept(tmp_path, capsys):
    lines = [GOOD[0], json.dumps({"text": ""}) + "\n", GOOD[1]]
    source = _write_lines(tmp_path / "holes.jsonl", lines)
    assert preprocess.main(_gpt2_args(source, tmp_path / "dropped")) == 0
    assert "Dropped 1 empty documents" in capsys.readouterr().err
    assert len(MMapIndexedDataset(f"{tmp_path}/dropped_text_document").doc_idx) == 3
    assert preprocess.main(_gpt2_args(source, tmp_path / "kept", "--keep-empty")) == 0
    kept = MMapIndexedDataset(f"{tmp_path}/kept_text_document")
    assert len(kept.doc_idx) == 4
    assert kept.get(1).tolist() == [EOD]


EMPTY_TEXT = json.dumps({"text": ""}) + "\n"


@pytest.mark.parametrize(
    "lines, extra, empty_key, documents",
    [
        ([EMPTY_TEXT] * 3, [], "text", 3),
        ([EMPTY_TEXT, "not json\n", EMPTY_TEXT], ["--skip-invalid"], "text", 2),
        (
            [json.dumps({"text": f"body {i}", "title": ""}) + "\n" for i in range(3)],
            ["--json-keys", "text", "title"],
            "title",
            3,
        ),
    ],
)
def test_all_documents_empty_is_an_error(tmp_path, capsys, lines, extra, empty_key, documents):
    source = _write_lines(tmp_path / "hollow.jsonl", lines)
    prefix = tmp_path / "out" / "hollow"
    assert preprocess.main(_gpt2_args(source, prefix, *extra)) == 1
    error = capsys.readouterr().err
    assert [line for line in error.splitlines() if line.startswith("error:")] == [
        f"error: --input {source}: all {documents} documents were empty (their '{empty_key}'"
        " tokenized to nothing), so there is nothing to train on;"
        " --keep-empty keeps empty documents"
    ], error
    _assert_no_outputs(str(prefix))
    assert preprocess.main(_gpt2_args(source, tmp_path / "kept", "--keep-empty", *extra)) == 0
    kept = MMapIndexedDataset(f"{tmp_path}/kept_{empty_key}_document")
    assert [kept.get(i).tolist() for i in range(len(kept))] == [[EOD]] * documents


def test_several_json_keys(tmp_path):
    lines = [json.dumps({"text": f"body {i}", "title": f"title {i}"}) + "\n" for i in range(4)]
    source = _write_lines(tmp_path / "keys.jsonl", lines)
    prefix = tmp_path / "keys"
    assert preprocess.main(_gpt2_args(source, prefix, "--json-keys", "text", "title")) == 0
    assert len(MMapIndexedDataset(f"{prefix}_text_document")) == 4
    assert len(MMapIndexedDataset(f"{prefix}_title_document")) == 4


def test_split_sentences_writes_sentence_level(tmp_path):
    source = _write_lines(tmp_path / "sentences.jsonl", GOOD)
    prefix = tmp_path / "sentences"
    assert preprocess.main(_gpt2_args(source, prefix, "--split-sentences")) == 0
    dataset = MMapIndexedDataset(f"{prefix}_text_sentence")
    assert len(dataset.doc_idx) == len(GOOD) + 1
    assert len(dataset) == 2 * len(GOOD)
    assert all(dataset.get(int(end) - 1)[-1] == EOD for end in dataset.doc_idx[1:])


def test_killed_run_leaves_no_complete_looking_pair(tmp_path):
    source = _write_lines(tmp_path / "big.jsonl", [line for _ in range(400) for line in GOOD])
    prefix = tmp_path / "killed"
    command = [sys.executable, str(REPO / "tools" / "preprocess_data.py")]
    command += _gpt2_args(source, prefix, "--log-interval", "50", "--chunk-size", "1", workers=1)
    # The user's command line; PYTHONPATH for a checkout that is not installed.
    environment = dict(os.environ, PYTHONPATH=str(REPO))
    process = subprocess.Popen(
        command, stderr=subprocess.PIPE, text=True, start_new_session=True, env=environment
    )
    line = process.stderr.readline()
    while line and not line.startswith("Processed"):
        line = process.stderr.readline()
    assert line.startswith("Processed"), "the run ended before it could be interrupted"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    time.sleep(0.1)
    assert not Path(f"{prefix}_text_document.idx").exists()
    assert not Path(f"{prefix}_text_document.bin").exists()


def test_without_tiktoken_the_files_are_identical(sample_outputs, tmp_path, monkeypatch):
    # The `tokenizers` pipeline stands in where tiktoken is not installed, byte for byte.
    from megatron.data import document_encoder

    monkeypatch.setitem(sys.modules, "tiktoken", None)
    monkeypatch.setattr(document_encoder, "_tokenizer", None)
    prefix = tmp_path / "no_tiktoken"
    assert preprocess.main(_gpt2_args(CORPUS, prefix, workers=2)) == 0
    assert document_encoder._tokenizer.engine == "tokenizers"
    for suffix in (".bin", ".idx"):
        expected = Path(str(sample_outputs[2]) + suffix).read_bytes()
        assert Path(f"{prefix}_text_document{suffix}").read_bytes() == expected


def test_a_long_document_is_encoded_in_pieces_like_the_whole(tmp_path):
    # Over a million characters: tokenized in pieces cut where GPT-2's pattern cuts anyway.
    text = "\n\n".join(_documents())[:2_500_000]
    corpus = tmp_path / "long.jsonl"
    _write_lines(corpus, [json.dumps({"text": text}) + "\n"])
    prefix = tmp_path / "long"
    assert preprocess.main(_gpt2_args(corpus, prefix, workers=2)) == 0
    dataset = MMapIndexedDataset(f"{prefix}_text_document")
    whole = build_tokenizer("GPT2BPETokenizer", vocab_file=str(VOCAB), merge_file=str(MERGES))
    assert whole.engine == "tiktoken"
    np.testing.assert_array_equal(dataset.get(0), whole.tokenize(text) + [EOD])
