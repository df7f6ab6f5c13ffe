"""An independent pure-Python GPT-2 byte-level BPE encoder, the oracle for the tokenizer tests.

Written from the published GPT-2 algorithm: split text with the GPT-2 regex, map each
piece's UTF-8 bytes to printable unicode characters, then repeatedly merge the adjacent
pair with the lowest merge rank until no ranked pair remains. It deliberately shares no
code with megatron/tokenizer so that agreement between the two means something.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Dict, List, Tuple

import regex

# The pattern from OpenAI's GPT-2 release: English contractions, optional-space-prefixed
# letter runs, number runs and symbol runs, then whitespace (trailing run minus its last
# space, so that space can prefix the next word).
GPT2_PATTERN = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)


@lru_cache(maxsize=1)
def bytes_to_unicode() -> Dict[int, str]:
    """Map every byte 0..255 to a printable unicode character, as GPT-2's vocab files do.

    Bytes that are already printable Latin-1 characters map to themselves; the remaining
    68 (control characters, space, soft hyphen, ...) map to code points 256, 257, ... in
    byte order.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table: Dict[int, str] = {}
    next_code_point = 256
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(next_code_point)
            next_code_point += 1
    return table


class ReferenceGPT2Encoder:
    """OpenAI GPT-2 encoder semantics: no special tokens, every string is plain BPE."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        with open(vocab_file, encoding="utf-8") as handle:
            self.encoder: Dict[str, int] = json.load(handle)
        self.decoder: Dict[int, str] = {index: token for token, index in self.encoder.items()}
        with open(merge_file, encoding="utf-8") as handle:
            lines = handle.read().split("\n")
        # First line is the "#version" header; blank lines (e.g. the trailing one) are not merges.
        merges = [tuple(line.split()) for line in lines[1:] if line.strip()]
        self.merge_ranks: Dict[Tuple[str, str], int] = {
            pair: rank for rank, pair in enumerate(merges)
        }
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {char: byte for byte, char in self.byte_encoder.items()}
        # Latin-1 decoding turns bytes into code points 0..255 one-to-one, so a str.translate
        # table then applies the byte-to-unicode map in C rather than a Python loop.
        self._latin1_to_unicode = {byte: char for byte, char in self.byte_encoder.items()}
        self._word_cache: Dict[str, List[int]] = {}

    def bpe(self, word: str) -> List[str]:
        """Merge a byte-mapped word greedily, lowest-ranked pair first; return its pieces."""
        parts = list(word)
        while len(parts) > 1:
            best_rank = None
            best_pair = None
            for pair in zip(parts, parts[1:]):
                rank = self.merge_ranks.get(pair)
                if rank is not None and (best_rank is None or rank < best_rank):
                    best_rank = rank
                    best_pair = pair
            if best_pair is None:
                break
            first, second = best_pair
            merged: List[str] = []
            index = 0
            # Merge every non-overlapping occurrence of the pair, scanning left to right.
            while index < len(parts):
                if index < len(parts) - 1 and parts[index] == first and parts[index + 1] == second:
                    merged.append(first + second)
                    index += 2
                else:
                    merged.append(parts[index])
                    index += 1
            parts = merged
        return parts

    def encode_word(self, word: str) -> List[int]:
        """Token ids of one regex piece, cached because natural text repeats words heavily."""
        cached = self._word_cache.get(word)
        if cached is not None:
            return cached
        mapped = word.encode("utf-8").decode("latin-1").translate(self._latin1_to_unicode)
        ids = [self.encoder[piece] for piece in self.bpe(mapped)]
        self._word_cache[word] = ids
        return ids

    def encode(self, text: str) -> List[int]:
        """Token ids of `text`; "<|endoftext|>" in the text is ordinary BPE, not the special id."""
        ids: List[int] = []
        for word in GPT2_PATTERN.findall(text):
            ids.extend(self.encode_word(word))
        return ids

    def decode(self, ids: List[int]) -> str:
        """Text of `ids`; invalid UTF-8 byte sequences become U+FFFD, as in GPT-2."""
        mapped = "".join(self.decoder[index] for index in ids)
        return bytes(self.byte_decoder[char] for char in mapped).decode("utf-8", errors="replace")
