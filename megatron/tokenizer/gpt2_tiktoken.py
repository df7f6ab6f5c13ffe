"""GPT-2's BPE on `tiktoken`, built from the same vocab.json and merges.txt: the fast encoder.

tiktoken merges by the rank of the merged bytes, the original GPT-2 encoder by the rank of the
merged pair. The two agree on GPT-2's own vocabulary (OpenAI's tiktoken `gpt2` encoding is built
from it; tests/tokenizer checks every sample document and random text against an independent
encoder), but not on every BPE vocabulary one could write: a token reachable by two pair
sequences can be merged by tiktoken where the pair list never merges it. So tiktoken is used
only when the files hold GPT-2's published vocabulary and merges (compared by content, so
re-serialized copies count), and `megatron.tokenizer.gpt2_bpe` keeps the `tokenizers` pipeline
for anything else and wherever tiktoken is not installed.

No special tokens are registered: "<|endoftext|>" inside a document is plain text, split and
merged like any other, as in Megatron's GPT-2 tokenizer (`encode_ordinary`).
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Dict, List

# OpenAI's GPT-2 split pattern in tiktoken's spelling (the contractions grouped).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOD_TOKEN = "<|endoftext|>"
# SHA-256 of `_content_digest`'s canonical form of GPT-2's published vocab.json and merges.txt,
# and of the two files as Megatron's examples download them (gpt2-vocab.json, gpt2-merges.txt):
# the byte check is the quick one.
GPT2_FILES_SHA256 = "036d5aa61c961c404a2636b474318c7b1cc873fff6ddcec95f2e80c5e661e0de"
GPT2_VOCAB_FILE_SHA256 = "3883827140ce17ad540fb21b7fd97c35f50e6ffc1435b0af34e465012286275b"
GPT2_MERGES_FILE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"


@lru_cache(maxsize=1)
def byte_decoder() -> Dict[int, int]:
    """GPT-2's printable stand-in character of every byte (as a code point), mapped back to
    the byte: a `str.translate` table whose output encodes to the bytes as Latin-1."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {byte: byte for byte in printable}
    shifted = 256
    for byte in range(256):
        if byte not in table:
            table[byte] = shifted
            shifted += 1
    return {character: byte for byte, character in table.items()}


def read_merges(merge_file: str) -> List[str]:
    """The merge lines of a merges.txt, without its `#version` header and blank lines."""
    with open(merge_file, encoding="utf-8") as handle:
        lines = [line.rstrip("\n") for line in handle]
    return [line for line in lines if line and not line.startswith("#version")]


def _content_digest(vocab: Dict[str, int], merges: List[str]) -> str:
    digest = hashlib.sha256()
    for token, index in sorted(vocab.items(), key=lambda item: item[1]):
        digest.update(f"{index}\t{token}\n".encode("utf-8", "surrogatepass"))
    digest.update(b"\0")
    digest.update("\n".join(merges).encode("utf-8"))
    return digest.hexdigest()


def _file_sha256(path: str) -> str:
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


def is_published_gpt2(vocab: Dict[str, int], merge_file: str, vocab_file: str = "") -> bool:
    """Whether `vocab` (read from `vocab_file`) and `merge_file` hold GPT-2's published
    tokens, ids and merges."""
    if len(vocab) != 50257 or vocab.get(EOD_TOKEN) != 50256:
        return False  # cheap rejection before reading the merges
    if vocab_file and _file_sha256(vocab_file) == GPT2_VOCAB_FILE_SHA256:
        if _file_sha256(merge_file) == GPT2_MERGES_FILE_SHA256:
            return True
    return _content_digest(vocab, read_merges(merge_file)) == GPT2_FILES_SHA256


def build_tiktoken_gpt2(vocab: Dict[str, int], merge_file: str, vocab_file: str = ""):
    """A `tiktoken.Encoding` equal to GPT-2's encoder, or None (tiktoken missing, or files
    that are not GPT-2's: the module docstring says why)."""
    try:
        import tiktoken
    except ImportError:
        return None
    if not is_published_gpt2(vocab, merge_file, vocab_file):
        return None
    decode = byte_decoder()
    ranks = {
        token.translate(decode).encode("latin-1"): index
        for token, index in vocab.items()
        if token != EOD_TOKEN
    }
    return tiktoken.Encoding(
        "gpt2-from-files", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={}
    )
