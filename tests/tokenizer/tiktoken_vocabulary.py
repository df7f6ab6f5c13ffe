"""A real tiktoken vocabulary in Megatron-Core's JSON form, written from the bundled GPT-2 files,
and an independent encoder of what Megatron-Core's TikTokenizer gives for it.

GPT-2's token of id 256 + k is the result of its merge k, so the file is the 256 single bytes in
byte order (Megatron-Core's form requires it) then GPT-2's merged tokens in merge order: entry
r >= 256 is merge r - 256. The oracle splits a text with the pattern, then merges each piece
with GPT-2's pair ranks (tests/tokenizer/reference_gpt2_encoder.py, sharing no code with
megatron/tokenizer), cut to the merges the vocabulary keeps.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import List, Sequence

import regex

from tests.tokenizer.reference_gpt2_encoder import ReferenceGPT2Encoder

SAMPLE_DIR = Path(__file__).resolve().parents[2] / "data" / "sample"
VOCAB_FILE = str(SAMPLE_DIR / "gpt2-vocab.json")
MERGE_FILE = str(SAMPLE_DIR / "gpt2-merges.txt")
GPT2_MERGED_TOKENS = 50000  # merges.txt's merges; with the 256 bytes, the file's 50,256 entries

# Megatron-Core's split patterns (megatron/core/tokenizers/.../tiktoken_tokenizer.py), as data.
PATTERN_V1 = r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
PATTERN_V2 = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEFAULT_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]


def write_gpt2_tiktoken_vocabulary(path: Path) -> int:
    """Write the file; returns its number of entries (50,256)."""
    encoder = ReferenceGPT2Encoder(VOCAB_FILE, MERGE_FILE)
    entries = []
    for rank in range(256 + GPT2_MERGED_TOKENS):
        if rank < 256:
            token = bytes([rank])
        else:
            token = bytes(encoder.byte_decoder[char] for char in encoder.decoder[rank])
        entries.append(
            {
                "rank": rank,
                "token_bytes": base64.b64encode(token).decode("ascii"),
                "token_str": token.decode("utf-8", errors="replace"),
            }
        )
    path.write_text(json.dumps(entries))
    return len(entries)


class MegatronCoreTikTokenOracle:
    """The ids Megatron-Core's TikTokenizer gives for the GPT-2 file: special tokens 0..S-1
    (named ones, then <SPECIAL_k> fillers), vocabulary rank r at id r + S, cut to V - S
    entries; a special token written in the text is its id."""

    def __init__(
        self,
        pattern: str,
        vocab_size: int,
        num_special_tokens: int = 1000,
        special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS,
    ) -> None:
        self.encoder = ReferenceGPT2Encoder(VOCAB_FILE, MERGE_FILE)
        kept_merges = vocab_size - num_special_tokens - 256
        self.encoder.merge_ranks = {
            pair: rank for pair, rank in self.encoder.merge_ranks.items() if rank < kept_merges
        }
        self.split = regex.compile(pattern)
        fillers = [f"<SPECIAL_{k}>" for k in range(len(special_tokens), num_special_tokens)]
        self.special_ids = {token: index for index, token in enumerate([*special_tokens, *fillers])}
        self.special = re.compile("|".join(map(re.escape, self.special_ids)))
        self.shift = num_special_tokens

    def _ordinary(self, text: str) -> List[int]:
        ids = []
        for piece in self.split.findall(text):
            mapped = (
                piece.encode("utf-8").decode("latin-1").translate(self.encoder._latin1_to_unicode)
            )
            for token in self.encoder.bpe(mapped):
                gpt2_id = self.encoder.encoder[token]
                # GPT-2's single-byte tokens are not in byte order; the file's first 256 are.
                rank = self.encoder.byte_decoder[token] if len(token) == 1 else gpt2_id
                ids.append(rank + self.shift)
        return ids

    def encode(self, text: str) -> List[int]:
        """Token ids of `text`."""
        ids, start = [], 0
        for match in self.special.finditer(text):
            ids += self._ordinary(text[start : match.start()]) + [self.special_ids[match.group()]]
            start = match.end()
        return ids + self._ordinary(text[start:])
