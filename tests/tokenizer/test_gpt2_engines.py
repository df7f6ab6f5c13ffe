"""Both GPT-2 engines give the independent reference encoder's ids on random text, long texts
cut into pieces encode as the whole does, and tiktoken is used only where it is exact."""

from __future__ import annotations

import json
import sys
import unicodedata
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron.tokenizer import GPT2BPETokenizer
from megatron.tokenizer.gpt2_bpe import safe_cuts
from megatron.tokenizer.gpt2_tiktoken import is_published_gpt2
from tests.tokenizer.reference_gpt2_encoder import ReferenceGPT2Encoder

SAMPLE_DIR = Path(__file__).resolve().parents[2] / "data" / "sample"
VOCAB_FILE = str(SAMPLE_DIR / "gpt2-vocab.json")
MERGE_FILE = str(SAMPLE_DIR / "gpt2-merges.txt")

# Code points assigned in this Python's Unicode database. The engines' regex libraries carry
# their own Unicode tables, so a character assigned later (a letter to one, unassigned to
# another) splits differently; upstream Megatron's `regex` differs from each in the same way.
ASSIGNED = st.characters(exclude_categories=("Cs", "Cn"))
WHITESPACE = st.text(st.sampled_from(" \t\n\r\x0b\x0c\x1c\x1f\x85\xa0\u2028\u3000"), min_size=1)
PIECES = st.sampled_from(
    [
        "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL", "'", "O'Neil",
        "<|endoftext|>", "<|endoftext", "endoftext|>",
        "0", "42", "3.14", "1,000", "٣٤", "½", "Ⅻ",
        "😀", "👍🏽", "👨\u200d👩\u200d👧", "🇺🇸", "❤️",
        "the", " the", "The", "e\u0301", "中文", "日本語", "Привет", "!?", "...", "--", "_",
    ]
)  # fmt: skip
TEXT = st.lists(
    st.one_of(PIECES, WHITESPACE, st.text(ASSIGNED, max_size=4), st.integers(0, 10**12).map(str)),
    max_size=24,
).map("".join)
CHECKS = settings(
    max_examples=1500,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def reference() -> ReferenceGPT2Encoder:
    return ReferenceGPT2Encoder(VOCAB_FILE, MERGE_FILE)


@pytest.fixture(scope="module", params=["tiktoken", "tokenizers"])
def tokenizer(request) -> GPT2BPETokenizer:
    return GPT2BPETokenizer(VOCAB_FILE, MERGE_FILE, engine=request.param)


@CHECKS
@given(text=TEXT)
def test_random_text_gives_the_reference_ids(tokenizer, reference, text):
    assert all(unicodedata.category(character) != "Cn" for character in text)
    expected = reference.encode(text)
    assert tokenizer.tokenize(text) == expected
    assert tokenizer.tokenize_arrays([text])[0].tolist() == expected


@CHECKS
@given(text=TEXT, piece=st.integers(1, 12))
def test_pieces_cut_at_safe_points_encode_as_the_whole(reference, text, piece):
    pieces = list(safe_cuts(text, piece))
    assert "".join(pieces) == text
    assert [i for part in pieces for i in reference.encode(part)] == reference.encode(text)


def test_long_documents_are_cut_and_encode_as_the_whole(tokenizer):
    # Three pieces through the engine's own piece loop, against one unsplit encode.
    text = ("It's 12:30 -- time's up!\n\n  Über café 😀 'll ...\t" * 60_000)[:2_500_000]
    assert len(list(safe_cuts(text))) == 3
    expected = GPT2BPETokenizer(VOCAB_FILE, MERGE_FILE, engine="tokenizers").tokenize(text)
    assert tokenizer.tokenize_arrays([text])[0].tolist() == expected


def test_auto_takes_tiktoken_for_gpt2_files_only(tmp_path, monkeypatch):
    assert GPT2BPETokenizer(VOCAB_FILE, MERGE_FILE).engine == "tiktoken"
    # A re-serialized copy of GPT-2's vocab is still GPT-2's.
    with open(VOCAB_FILE, encoding="utf-8") as handle:
        vocab = json.load(handle)
    compact = tmp_path / "compact-vocab.json"
    compact.write_text(json.dumps(vocab, separators=(",", ":")), encoding="utf-8")
    assert GPT2BPETokenizer(str(compact), MERGE_FILE).engine == "tiktoken"
    # Any other vocabulary keeps the exact pair-merging pipeline.
    swapped = dict(vocab)
    swapped["Ġthe"], swapped["Ġa"] = vocab["Ġa"], vocab["Ġthe"]
    other = tmp_path / "other-vocab.json"
    other.write_text(json.dumps(swapped), encoding="utf-8")
    assert not is_published_gpt2(swapped, MERGE_FILE)
    assert GPT2BPETokenizer(str(other), MERGE_FILE).engine == "tokenizers"
    with pytest.raises(ValueError, match="tiktoken engine needs"):
        GPT2BPETokenizer(str(other), MERGE_FILE, engine="tiktoken")
    merges = tmp_path / "merges.txt"
    lines = Path(MERGE_FILE).read_text(encoding="utf-8").splitlines(keepends=True)
    merges.write_text("".join(lines[:-1]), encoding="utf-8")  # the last merge dropped
    assert GPT2BPETokenizer(VOCAB_FILE, str(merges)).engine == "tokenizers"
    # Without tiktoken installed, the `tokenizers` pipeline encodes.
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    fallback = GPT2BPETokenizer(VOCAB_FILE, MERGE_FILE)
    assert fallback.engine == "tokenizers"
    assert fallback.tokenize("Hello world") == [15496, 995]
