"""Megatron-Core's TikTokenizer: a byte-level BPE vocabulary in its JSON form, on `tiktoken`.

The file (--tokenizer-model, a .json) is a list of {"rank": i, "token_bytes": base64 of the
token's bytes, "token_str": its text}, entry i of rank i, the first 256 the single bytes 0..255
in order; a token's rank orders the merges. The ids are Megatron-Core's:

- ids 0..S-1 are the special tokens (S = --tiktoken-num-special-tokens, default 1000): the
  named ones (--tokenizer-special-tokens, default <unk> <s> </s> <mask> <pad> <cls> <sep>), then
  fillers <SPECIAL_k> for k = their count .. S-1;
- the vocabulary follows, rank r at id r + S, cut to its first V - S entries (V = --vocab-size,
  default 2**17): `vocab_size` is V, whatever the file's length beyond that;
- `eod` is the id of </s>; nothing is added per text;
- a special token written literally in a text ("</s>", "<SPECIAL_12>") becomes its id, as
  Megatron-Core encodes with every special token allowed.

Texts are split with Megatron-Core's v1 or v2 pattern (--tiktoken-pattern, default v2).
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Dict, List, Sequence, Tuple, Union

from megatron.tokenizer.base import TokenizerBase
from megatron.tokenizer.flags import TIKTOKEN_PATTERNS

SPECIAL_FILLER = "<SPECIAL_{}>"
ENTRY_KEYS = {"rank", "token_bytes", "token_str"}


def read_ranks(path: str, max_entries: int) -> Dict[bytes, int]:
    """{token bytes: rank} of the first `max_entries` entries of a Megatron-Core tiktoken JSON
    vocabulary; ValueError naming --tokenizer-model and the entry where it is not one."""
    where = f"--tokenizer-model {path}"
    if not path.endswith(".json"):
        raise ValueError(
            f"{where}: TikTokenizer reads a .json vocabulary (Megatron-Core's list of "
            '{"rank", "token_bytes", "token_str"}); pass such a file'
        )
    with open(path, encoding="utf-8") as handle:
        try:
            entries = json.load(handle)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{where} is not valid JSON ({error}); pass a tiktoken .json"
            ) from None
    if not isinstance(entries, list):
        raise ValueError(
            f"{where} holds a JSON {type(entries).__name__}, not the list of "
            '{"rank", "token_bytes", "token_str"} entries Megatron-Core\'s TikTokenizer reads'
        )
    ranks: Dict[bytes, int] = {}
    for index, entry in enumerate(entries[:max_entries]):
        if not isinstance(entry, dict) or set(entry) != ENTRY_KEYS or entry["rank"] != index:
            raise ValueError(
                f"{where}: entry {index} is not {{'rank': {index}, 'token_bytes': ..., "
                "'token_str': ...}; each entry holds exactly these keys, in rank order"
            )
        try:
            token = base64.b64decode(entry["token_bytes"], validate=True)
        except (binascii.Error, TypeError):
            raise ValueError(f"{where}: entry {index}'s token_bytes is not base64") from None
        if index < 256 and token != bytes([index]):
            raise ValueError(
                f"{where}: entry {index} must be the single byte {index} (the first 256 "
                "entries are the bytes 0..255 in order)"
            )
        if token in ranks:
            raise ValueError(
                f"{where}: entries {ranks[token]} and {index} hold the same bytes {token!r}"
            )
        ranks[token] = index
    return ranks


class TikTokenizer(TokenizerBase):
    """Megatron-Core's TikTokenizer of a JSON vocabulary (module docstring for the ids)."""

    def __init__(
        self,
        path: str,
        pattern: str,
        vocab_size: int,
        num_special_tokens: int,
        special_tokens: Sequence[str],
    ) -> None:
        try:
            import tiktoken
        except ImportError:
            raise ValueError(
                "--tokenizer-type TikTokenizer needs the tiktoken package: pip install tiktoken"
            ) from None
        self.tokenizer_model = path
        self._vocab_size = vocab_size
        inner_size = vocab_size - num_special_tokens
        ranks = read_ranks(path, inner_size)
        if len(ranks) < inner_size:
            raise ValueError(
                f"--tokenizer-model {path} holds {len(ranks)} tokens, fewer than --vocab-size "
                f"{vocab_size} minus --tiktoken-num-special-tokens {num_special_tokens} "
                f"({inner_size}); give --vocab-size {len(ranks) + num_special_tokens} or less"
            )
        fillers = [SPECIAL_FILLER.format(k) for k in range(len(special_tokens), num_special_tokens)]
        special_ids = {token: index for index, token in enumerate([*special_tokens, *fillers])}
        self._encoding = tiktoken.Encoding(
            name="megatron-tiktoken",
            pat_str=TIKTOKEN_PATTERNS[pattern],
            mergeable_ranks={token: rank + num_special_tokens for token, rank in ranks.items()},
            special_tokens=special_ids,
        )
        self.num_special_tokens = num_special_tokens
        self._special_ids = special_ids
        self._ranks = ranks
        self._eod = special_ids["</s>"]

    @property
    def vocab_size(self) -> int:
        """--vocab-size (special tokens included), before padding."""
        return self._vocab_size

    @property
    def vocab(self) -> Dict[Union[str, bytes], int]:
        """Special token (str) or vocabulary token (its bytes) to id, as in Megatron-Core."""
        shift = self.num_special_tokens
        return {**self._special_ids, **{token: rank + shift for token, rank in self._ranks.items()}}

    @property
    def inv_vocab(self) -> Dict[int, Union[str, bytes]]:
        """Id to special token (str) or vocabulary token (bytes)."""
        return {index: token for token, index in self.vocab.items()}

    @property
    def special_tokens(self) -> Tuple[str, ...]:
        """The special tokens in id order, fillers included."""
        return tuple(self._special_ids)

    def tokenize(self, text: str) -> List[int]:
        """Token ids of one text; special tokens written in it become their ids."""
        return self._encoding.encode(text, allowed_special="all")

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Token ids of many texts, one thread (callers run one process per core)."""
        return [self.tokenize(text) for text in texts]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids`; invalid UTF-8 byte sequences become U+FFFD."""
        return self._encoding.decode(list(token_ids))
