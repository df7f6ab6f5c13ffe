"""SentencePiece and Hugging Face tokenizer wrappers, build_tokenizer errors, vocab padding."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import pytest
import sentencepiece

from megatron.tokenizer import (
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
    vocab_size_with_padding,
)

SAMPLE_DIR = Path(__file__).resolve().parents[2] / "data" / "sample"
VOCAB_FILE = str(SAMPLE_DIR / "gpt2-vocab.json")
MERGE_FILE = str(SAMPLE_DIR / "gpt2-merges.txt")
DOCS_FILE = SAMPLE_DIR / "openwebtext-1000.jsonl.xz"


@pytest.fixture(scope="module")
def documents() -> list[str]:
    with lzma.open(DOCS_FILE, "rt", encoding="utf-8") as handle:
        return [json.loads(line)["text"] for line in handle][:300]


@pytest.fixture(scope="module")
def gpt2_tokenizer() -> GPT2BPETokenizer:
    return GPT2BPETokenizer(VOCAB_FILE, MERGE_FILE)


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory: pytest.TempPathFactory, documents: list[str]) -> str:
    """A real 500-piece BPE SentencePiece model trained on 300 sample documents."""
    directory = tmp_path_factory.mktemp("sentencepiece")
    corpus = directory / "corpus.txt"
    with open(corpus, "w", encoding="utf-8") as handle:
        for document in documents:
            for line in document.split("\n"):
                if line.strip():
                    handle.write(line + "\n")
    prefix = directory / "sample"
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(prefix),
        vocab_size=500,
        model_type="bpe",
        num_threads=2,
        minloglevel=2,
    )
    return str(prefix) + ".model"


@pytest.fixture(scope="module")
def gpt2_tokenizer_json(tmp_path_factory: pytest.TempPathFactory, gpt2_tokenizer) -> str:
    """tokenizer.json of the GPT-2 pipeline, no added tokens (so no eod can be inferred)."""
    path = tmp_path_factory.mktemp("hf_plain") / "tokenizer.json"
    gpt2_tokenizer.hf_tokenizer.save(str(path))
    return str(path)


# --- SentencePiece --------------------------------------------------------------------------


def test_sentencepiece_matches_library(sentencepiece_model: str, documents: list[str]) -> None:
    tokenizer = SentencePieceTokenizer(sentencepiece_model)
    processor = sentencepiece.SentencePieceProcessor(model_file=sentencepiece_model)
    assert tokenizer.vocab_size == processor.get_piece_size() == 500
    assert tokenizer.eod == processor.eos_id() == 2
    assert tokenizer.vocab[processor.id_to_piece(100)] == 100
    assert tokenizer.inv_vocab[100] == processor.id_to_piece(100)
    sample = documents[:50]
    expected = [processor.encode(document, out_type=int) for document in sample]
    assert [tokenizer.tokenize(document) for document in sample] == expected
    assert tokenizer.tokenize_batch(sample) == expected
    assert tokenizer.eod not in expected[0]
    text = "The quick brown fox jumps over the lazy dog."
    assert tokenizer.detokenize(tokenizer.tokenize(text)) == text


@pytest.mark.parametrize(
    "tokenizer_type", ["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"]
)
def test_sentencepiece_types_are_megatron_cores_one_tokenizer(
    sentencepiece_model: str, documents: list[str], tokenizer_type: str
) -> None:
    # Megatron-Core builds one SentencePiece wrapper for the three names: the model's encoding
    # (encode_as_ids), nothing added per text, eod its EOS piece, its pieces the vocabulary.
    tokenizer = build_tokenizer(tokenizer_type, tokenizer_model=sentencepiece_model)
    processor = sentencepiece.SentencePieceProcessor(model_file=sentencepiece_model)
    assert isinstance(tokenizer, SentencePieceTokenizer)
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.bos, tokenizer.pad) == (500, 2, 1, -1)
    assert (processor.eos_id(), processor.bos_id(), processor.pad_id()) == (2, 1, -1)
    sample = documents[:20]
    expected = [processor.encode_as_ids(document) for document in sample]
    assert tokenizer.tokenize_batch(sample) == expected
    assert all(ids[0] != processor.bos_id() for ids in expected)  # Llama2Tokenizer adds no BOS
    assert tokenizer.tokenize("") == []


# --- Hugging Face tokenizer.json ------------------------------------------------------------


def test_huggingface_json_matches_gpt2(
    gpt2_tokenizer_json: str, gpt2_tokenizer: GPT2BPETokenizer, documents: list[str]
) -> None:
    tokenizer = HuggingFaceTokenizer(gpt2_tokenizer_json, eod_token="<|endoftext|>")
    assert tokenizer.eod == 50256
    assert tokenizer.vocab_size == 50257
    assert tokenizer.vocab == gpt2_tokenizer.vocab
    sample = documents[:100] + ["a<|endoftext|>b", ""]
    expected = [gpt2_tokenizer.tokenize(document) for document in sample]
    assert [tokenizer.tokenize(document) for document in sample] == expected
    assert tokenizer.tokenize_batch(sample) == expected
    assert tokenizer.detokenize(expected[0]) == sample[0]


def test_huggingface_without_eod_names_file_and_fix(gpt2_tokenizer_json: str) -> None:
    with pytest.raises(ValueError, match="eod_token") as error:
        HuggingFaceTokenizer(gpt2_tokenizer_json)
    assert gpt2_tokenizer_json in str(error.value)
    assert "eos_token" in str(error.value)


def test_huggingface_unknown_eod_token(gpt2_tokenizer_json: str) -> None:
    with pytest.raises(ValueError, match="'<nope>'.*not in the vocab"):
        HuggingFaceTokenizer(gpt2_tokenizer_json, eod_token="<nope>")


@pytest.mark.parametrize(
    "eos_token", ["<|endoftext|>", {"__type": "AddedToken", "content": "<|endoftext|>"}]
)
def test_huggingface_directory_reads_config_eos(
    tmp_path: Path, gpt2_tokenizer: GPT2BPETokenizer, eos_token
) -> None:
    gpt2_tokenizer.hf_tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos_token}))
    tokenizer = HuggingFaceTokenizer(str(tmp_path))
    assert tokenizer.eod == 50256
    assert tokenizer.tokenize("Hello world") == [15496, 995]


def test_huggingface_finds_added_special_end_token(
    tmp_path: Path, gpt2_tokenizer: GPT2BPETokenizer
) -> None:
    # Like GPT-2's official tokenizer.json: "<|endoftext|>" is an added special token, so it is
    # found without configuration, and (HF semantics) its literal text maps to the special id.
    hf_tokenizer = GPT2BPETokenizer(VOCAB_FILE, MERGE_FILE).hf_tokenizer
    hf_tokenizer.add_special_tokens(["<|endoftext|>"])
    hf_tokenizer.save(str(tmp_path / "tokenizer.json"))
    tokenizer = HuggingFaceTokenizer(str(tmp_path / "tokenizer.json"))
    assert tokenizer.eod == 50256
    assert tokenizer.vocab_size == 50257
    assert tokenizer.tokenize("a<|endoftext|>") == [64, 50256]
    assert gpt2_tokenizer.tokenize("a<|endoftext|>") != [64, 50256]


def test_huggingface_directory_without_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        HuggingFaceTokenizer(str(tmp_path))


# --- build_tokenizer ------------------------------------------------------------------------


def test_build_tokenizer_each_type(
    sentencepiece_model: str, gpt2_tokenizer_json: str, tmp_path: Path
) -> None:
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=VOCAB_FILE, merge_file=MERGE_FILE)
    assert isinstance(gpt2, GPT2BPETokenizer) and gpt2.eod == 50256
    sp = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sentencepiece_model)
    assert isinstance(sp, SentencePieceTokenizer) and sp.vocab_size == 500
    hf = build_tokenizer(
        "HuggingFaceTokenizer", tokenizer_model=gpt2_tokenizer_json, eod_token="<|endoftext|>"
    )
    assert isinstance(hf, HuggingFaceTokenizer) and hf.eod == 50256


@pytest.mark.parametrize(
    "tokenizer_type, kwargs, flag",
    [
        ("GPT2BPETokenizer", {"merge_file": MERGE_FILE}, "--vocab-file"),
        ("GPT2BPETokenizer", {"vocab_file": VOCAB_FILE}, "--merge-file"),
        ("SentencePieceTokenizer", {}, "--tokenizer-model"),
        ("HuggingFaceTokenizer", {}, "--tokenizer-model"),
    ],
)
def test_build_tokenizer_missing_flag(tokenizer_type: str, kwargs: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=f"{flag}.*none was given"):
        build_tokenizer(tokenizer_type, **kwargs)


@pytest.mark.parametrize(
    "tokenizer_type, argument, flag",
    [
        ("GPT2BPETokenizer", "vocab_file", "--vocab-file"),
        ("GPT2BPETokenizer", "merge_file", "--merge-file"),
        ("SentencePieceTokenizer", "tokenizer_model", "--tokenizer-model"),
        ("HuggingFaceTokenizer", "tokenizer_model", "--tokenizer-model"),
    ],
)
def test_build_tokenizer_nonexistent_path(
    tmp_path: Path, tokenizer_type: str, argument: str, flag: str
) -> None:
    kwargs = {"vocab_file": VOCAB_FILE, "merge_file": MERGE_FILE}
    missing = str(tmp_path / "missing.file")
    kwargs[argument] = missing
    with pytest.raises(ValueError) as error:
        build_tokenizer(tokenizer_type, **kwargs)
    assert flag in str(error.value) and missing in str(error.value)
    assert "does not exist" in str(error.value)


def test_build_tokenizer_unknown_type() -> None:
    with pytest.raises(ValueError, match="unknown --tokenizer-type 'BertWordPieceLowerCase'"):
        build_tokenizer("BertWordPieceLowerCase")


# --- vocab padding --------------------------------------------------------------------------


def test_padding_log_line() -> None:
    lines: list[str] = []
    assert vocab_size_with_padding(50257, 128, 1, log=lines.append) == 50304
    assert lines == [" > padded vocab (size: 50257) with 47 dummy tokens (new size: 50304)"]


def test_padding_default_log_prints(capsys: pytest.CaptureFixture) -> None:
    vocab_size_with_padding(50257, 128, 1)
    assert capsys.readouterr().out == (
        " > padded vocab (size: 50257) with 47 dummy tokens (new size: 50304)\n"
    )


@pytest.mark.parametrize(
    "orig, divisible_by, tp, expected",
    [
        (50257, 128, 1, 50304),
        (50257, 128, 2, 50432),
        (50257, 128, 8, 51200),
        (50257, 1024, 1, 51200),
        (50257, 1024, 2, 51200),
        (50257, 1024, 4, 53248),
        (50304, 128, 1, 50304),
        (50304, 128, 2, 50432),
        (500, 128, 1, 512),
        (1, 1, 1, 1),
        (32000, 64, 2, 32000),
    ],
)
def test_padding_values(orig: int, divisible_by: int, tp: int, expected: int) -> None:
    padded = vocab_size_with_padding(orig, divisible_by, tp, log=None)
    assert padded == expected
    assert padded % (divisible_by * tp) == 0 and 0 <= padded - orig < divisible_by * tp


def test_padding_rejects_zero_multiple() -> None:
    with pytest.raises(ValueError, match="--make-vocab-size-divisible-by"):
        vocab_size_with_padding(50257, 0, 1, log=None)
