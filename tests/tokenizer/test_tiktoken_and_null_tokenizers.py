"""Megatron-Core's TikTokenizer on a real vocabulary (GPT-2's, in Megatron-Core's JSON form)
against an independent encoder, and its NullTokenizer, each with their refusals."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import pytest

from megatron.tokenizer import NullTokenizer, TikTokenizer, build_tokenizer
from megatron.tokenizer.flags import TIKTOKEN_PATTERN_V1, TIKTOKEN_PATTERN_V2
from tests.tokenizer.tiktoken_vocabulary import (
    DEFAULT_SPECIAL_TOKENS,
    PATTERN_V1,
    PATTERN_V2,
    SAMPLE_DIR,
    MegatronCoreTikTokenOracle,
    write_gpt2_tiktoken_vocabulary,
)

ENTRIES = 50256  # the file's entries; with Megatron-Core's 1000 special ids, 51,256 ids in all
CRAFTED = [
    "Hello world, it's 2024!\n\n  Indented\tline\r\nend",
    "a</s>b <s> x<SPECIAL_7>y <mask><pad>",
    "Ünïcödé 😀 ÆØÅ, 東京 123456 don't WeIrD CaSe",
    "",
]


@pytest.fixture(scope="module")
def vocabulary(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiktoken") / "gpt2-tiktoken.json"
    assert write_gpt2_tiktoken_vocabulary(path) == ENTRIES
    return str(path)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    with lzma.open(SAMPLE_DIR / "openwebtext-1000.jsonl.xz", "rt", encoding="utf-8") as handle:
        documents = [json.loads(line)["text"] for _, line in zip(range(12), handle)]
    return documents + CRAFTED


def test_split_patterns_are_megatron_cores():
    assert (TIKTOKEN_PATTERN_V1, TIKTOKEN_PATTERN_V2) == (PATTERN_V1, PATTERN_V2)


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_tiktokenizer_ids_are_megatron_cores(vocabulary, texts, pattern):
    tokenizer = build_tokenizer(
        "TikTokenizer", tokenizer_model=vocabulary, tiktoken_pattern=pattern, vocab_size=51256
    )
    oracle = MegatronCoreTikTokenOracle({"v1": PATTERN_V1, "v2": PATTERN_V2}[pattern], 51256)
    assert isinstance(tokenizer, TikTokenizer)
    assert tokenizer.vocab_size == 51256 and tokenizer.eod == 2  # "</s>"
    assert tokenizer.tokenize_batch(texts) == [oracle.encode(text) for text in texts]
    assert tokenizer.tokenize("Hello") == [15496 + 1000]  # GPT-2's "Hello", shifted
    assert tokenizer.tokenize("a</s>")[-1] == 2 and tokenizer.tokenize("<SPECIAL_999>") == [999]
    assert tokenizer.detokenize(tokenizer.tokenize(texts[0])) == texts[0]


def test_tiktokenizer_named_special_tokens_and_a_cut_vocabulary(vocabulary, texts):
    special = [*DEFAULT_SPECIAL_TOKENS, "<tool>"]
    tokenizer = build_tokenizer(
        "TikTokenizer",
        tokenizer_model=vocabulary,
        vocab_size=20000,
        tiktoken_num_special_tokens=16,
        tokenizer_special_tokens=special,
    )
    oracle = MegatronCoreTikTokenOracle(PATTERN_V2, 20000, 16, special)
    assert tokenizer.special_tokens == (*special, *(f"<SPECIAL_{k}>" for k in range(8, 16)))
    assert tokenizer.vocab_size == 20000 and tokenizer.eod == 2
    ids = tokenizer.tokenize_batch(texts)
    assert ids == [oracle.encode(text) for text in texts]
    assert max(max(row, default=0) for row in ids) < 20000
    assert tokenizer.tokenize("<tool>") == [7] and tokenizer.tokenize("\x00") == [16]


@pytest.mark.parametrize(
    "content, expected",
    [
        ({"rank": 0}, "is not a JSON list|holds a JSON dict"),
        ([{"rank": 1, "token_bytes": "AA==", "token_str": "\x00"}], "entry 0 is not"),
        (
            [{"rank": 0, "token_bytes": "AQ==", "token_str": "\x01"}],
            "entry 0 must be the single byte 0",
        ),
    ],
)
def test_tiktokenizer_refuses_a_file_that_is_not_megatron_cores_form(tmp_path, content, expected):
    path = tmp_path / "vocab.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=expected) as error:
        build_tokenizer("TikTokenizer", tokenizer_model=str(path), vocab_size=1001)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_tiktokenizer_refuses_a_vocabulary_smaller_than_vocab_size(vocabulary):
    with pytest.raises(ValueError) as error:
        build_tokenizer("TikTokenizer", tokenizer_model=vocabulary)  # Megatron-Core's 2**17
    assert str(error.value) == (
        f"--tokenizer-model {vocabulary} holds {ENTRIES} tokens, fewer than --vocab-size 131072 "
        "minus --tiktoken-num-special-tokens 1000 (130072); give --vocab-size 51256 or less"
    )


def test_tiktokenizer_refuses_a_file_that_is_not_json(tmp_path):
    path = tmp_path / "tokenizer.model"
    path.write_text("x")
    with pytest.raises(ValueError, match="TikTokenizer reads a .json vocabulary"):
        build_tokenizer("TikTokenizer", tokenizer_model=str(path), vocab_size=2000)


# --- NullTokenizer --------------------------------------------------------------------------


def test_null_tokenizer_reads_ids_and_ends_documents_with_the_last_id():
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=512)
    assert isinstance(tokenizer, NullTokenizer)
    # Megatron-Core: vocab_size is --vocab-size, eod its last id, a text int() of each piece.
    assert (tokenizer.vocab_size, tokenizer.eod) == (512, 511)
    text = "3 1 4 1 5 9 511 0"
    assert tokenizer.tokenize(text) == [int(piece) for piece in text.split(" ")]
    assert tokenizer.tokenize_batch([text, ""]) == [[3, 1, 4, 1, 5, 9, 511, 0], []]
    assert tokenizer.detokenize([3, 1, 4]) == "3 1 4"


@pytest.mark.parametrize(
    "text, named",
    [("3 x 4", "'x' is not one"), ("3  4", "'' is not one"), ("3 512", "id 512 in the text")],
)
def test_null_tokenizer_refuses_text_that_is_not_its_ids(text, named):
    with pytest.raises(ValueError, match=named) as error:
        build_tokenizer("NullTokenizer", vocab_size=512).tokenize(text)
    assert str(error.value).startswith("--tokenizer-type NullTokenizer")


# --- Hugging Face hub ids -------------------------------------------------------------------


def test_a_hugging_face_hub_id_is_refused_with_how_to_get_a_local_copy():
    with pytest.raises(ValueError) as error:
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model="meta-llama/Llama-2-7b-hf")
    assert str(error.value) == (
        "--tokenizer-model meta-llama/Llama-2-7b-hf is not a local file or directory, and this "
        "project does not download tokenizers (no network): get a local copy with "
        "`huggingface-cli download meta-llama/Llama-2-7b-hf --local-dir DIR` and pass "
        "--tokenizer-model DIR"
    )


def test_a_missing_local_hugging_face_path_is_not_taken_for_a_hub_id(tmp_path: Path):
    missing = str(tmp_path / "tokenizer" / "tokenizer.json")
    with pytest.raises(ValueError, match="does not exist .*pass an existing file or directory"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=missing)
