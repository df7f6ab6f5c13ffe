"""GPT2BPETokenizer gives OpenAI GPT-2 ids: checked against an independent reference encoder."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import pytest

from megatron.tokenizer import GPT2BPETokenizer
from tests.tokenizer.reference_gpt2_encoder import ReferenceGPT2Encoder, bytes_to_unicode

SAMPLE_DIR = Path(__file__).resolve().parents[2] / "data" / "sample"
VOCAB_FILE = str(SAMPLE_DIR / "gpt2-vocab.json")
MERGE_FILE = str(SAMPLE_DIR / "gpt2-merges.txt")
DOCS_FILE = SAMPLE_DIR / "openwebtext-1000.jsonl.xz"

EDGE_CASES = [
    "",
    " ",
    "   ",
    "\n",
    "\n\n\n",
    "\t \t",
    "a  b   c    d",
    "trailing spaces   ",
    "   leading spaces",
    "line one\n\n  line two \r\n\tline three\u00a0\u3000end",
    "<|endoftext|>",
    "before<|endoftext|>after",
    "doc one.<|endoftext|> doc two <|endoftext|>\n",
    "I'm you're he's we've they'll she'd can't 'twas O'Neil 'S 'LL",
    "DON'T I'M It'S",
    "12345678901234567890 3.14159 -42 1,000,000 0x1F 1e-9",
    "½ ¾ ² ३४५ ١٢٣ Ⅻ",
    "emoji 😀👍🏽 👨‍👩‍👧‍👦 🇺🇸 ❤️",
    "中文分词测试，日本語のテキスト、한국어 텍스트",
    "Привет, мир! Γειά σου Κόσμε. שלום עולם. مرحبا بالعالم",
    "combining: e\u0301 n\u0303 a\u0308\u0308 \u200b\u200c\u200d\ufeff zero-width",
    "control \x00\x01\x1f\x7f\x85 chars",
    "symbols ~!@#$%^&*()_+{}|:\"<>?`-=[]\\;',./ ...",
    "https://example.com/path?query=1&b=2#frag user@example.com",
    "def f(x):\n    return x ** 2  # comment\n",
    "Ġ Ċ ĉ byte-level lookalikes ÿĀ",
    "\U0001d400\U0001d401 \U00010000 \U0010fffd math and plane-16",
]


@pytest.fixture(scope="module", params=["tiktoken", "tokenizers"])
def tokenizer(request) -> GPT2BPETokenizer:
    return GPT2BPETokenizer(VOCAB_FILE, MERGE_FILE, engine=request.param)


@pytest.fixture(scope="module")
def reference() -> ReferenceGPT2Encoder:
    return ReferenceGPT2Encoder(VOCAB_FILE, MERGE_FILE)


@pytest.fixture(scope="module")
def documents() -> list[str]:
    with lzma.open(DOCS_FILE, "rt", encoding="utf-8") as handle:
        return [json.loads(line)["text"] for line in handle]


def test_reference_encoder_matches_published_gpt2_ids(reference: ReferenceGPT2Encoder) -> None:
    # Anchors the oracle itself to well-known GPT-2 ids, so the two cannot agree on a wrong answer.
    assert reference.encode("Hello world") == [15496, 995]
    assert reference.encode(" the") == [262]
    assert reference.encode("<|endoftext|>") == [27, 91, 437, 1659, 5239, 91, 29]


def test_bytes_to_unicode_table() -> None:
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[ord("A")] == "A"


def test_sizes_and_eod(tokenizer: GPT2BPETokenizer) -> None:
    assert tokenizer.vocab_size == 50257
    assert tokenizer.eod == 50256
    assert tokenizer.vocab["<|endoftext|>"] == 50256
    assert tokenizer.inv_vocab[50256] == "<|endoftext|>"
    assert tokenizer.inv_vocab[tokenizer.vocab["Ġthe"]] == "Ġthe"
    assert len(tokenizer.inv_vocab) == 50257


@pytest.fixture(scope="module")
def reference_ids(reference: ReferenceGPT2Encoder, documents: list[str]) -> list[list[int]]:
    return [reference.encode(document) for document in documents]


def test_all_sample_documents_match_reference(
    tokenizer: GPT2BPETokenizer, reference_ids: list[list[int]], documents: list[str]
) -> None:
    assert len(documents) == 1000
    batch_ids = tokenizer.tokenize_batch(documents)
    arrays = tokenizer.tokenize_arrays(documents)
    total_tokens = 0
    for index, (document, ids) in enumerate(zip(documents, batch_ids)):
        expected = reference_ids[index]
        assert arrays[index].tolist() == expected, f"document {index} differs in tokenize_arrays"
        assert tokenizer.tokenize(document) == expected, f"document {index} differs"
        assert ids == expected, f"document {index} differs in tokenize_batch"
        assert tokenizer.detokenize(ids) == document, f"document {index} does not round-trip"
        total_tokens += len(ids)
    assert total_tokens > 1_000_000


@pytest.mark.parametrize("text", EDGE_CASES)
def test_edge_cases_match_reference(
    tokenizer: GPT2BPETokenizer, reference: ReferenceGPT2Encoder, text: str
) -> None:
    expected = reference.encode(text)
    assert tokenizer.tokenize(text) == expected
    assert tokenizer.tokenize_batch([text, text]) == [expected, expected]
    assert tokenizer.detokenize(expected) == text


def test_endoftext_in_text_is_plain_bpe(tokenizer: GPT2BPETokenizer) -> None:
    ids = tokenizer.tokenize("a<|endoftext|>b")
    assert tokenizer.eod not in ids
    assert ids == tokenizer.tokenize("a") + [27, 91, 437, 1659, 5239, 91, 29] + tokenizer.tokenize(
        "b"
    )
    # The eod id itself still decodes to the marker text.
    assert tokenizer.detokenize([tokenizer.eod]) == "<|endoftext|>"


def test_empty_inputs(tokenizer: GPT2BPETokenizer) -> None:
    assert tokenizer.tokenize("") == []
    assert tokenizer.tokenize_batch([]) == []
    assert tokenizer.tokenize_arrays([""])[0].size == 0
    assert tokenizer.detokenize([]) == ""


def test_detokenize_partial_utf8_matches_reference(
    tokenizer: GPT2BPETokenizer, reference: ReferenceGPT2Encoder
) -> None:
    # "€" is three UTF-8 bytes; dropping the last token leaves a truncated sequence.
    ids = tokenizer.tokenize("price: €")
    truncated = ids[:-1] + [tokenizer.vocab[bytes_to_unicode()[0xE2]]]
    assert tokenizer.detokenize(truncated) == reference.decode(truncated)
    assert "\ufffd" in tokenizer.detokenize(truncated)
