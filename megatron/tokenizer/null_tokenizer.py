"""Megatron-Core's NullTokenizer: no vocabulary file, the text is the token ids.

For data that is already token ids and for runs on --mock-data: `--vocab-size N` gives ids
0..N-1, the last of them (N - 1) the end-of-document id, as Megatron-Core defines it since 0.18
(before, N + 1 ids with N the end of a document). A text is read as Megatron-Core reads it,
integers separated by single spaces ("17 4 9"); an empty text has no ids (Megatron-Core would
stop on it). Unlike Megatron-Core, an id outside 0..N-1 or a piece that is not an integer is
refused with the piece named, rather than written.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

from megatron.tokenizer.base import TokenizerBase


class NullTokenizer(TokenizerBase):
    """Ids written as text: `tokenize("3 1 4") == [3, 1, 4]`; `eod` is `vocab_size - 1`."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 1:
            raise ValueError(f"--vocab-size {vocab_size} must be at least 1 for NullTokenizer")
        self._vocab_size = int(vocab_size)
        self._eod = self._vocab_size - 1

    @property
    def vocab_size(self) -> int:
        """--vocab-size, the end-of-document id included, before padding."""
        return self._vocab_size

    @property
    def vocab(self) -> Dict[str, int]:
        """NullTokenizer has no vocabulary (as in Megatron-Core)."""
        raise NotImplementedError("NullTokenizer has no vocabulary: its tokens are the ids")

    @property
    def inv_vocab(self) -> Dict[int, str]:
        """NullTokenizer has no vocabulary (as in Megatron-Core)."""
        raise NotImplementedError("NullTokenizer has no vocabulary: its tokens are the ids")

    def tokenize(self, text: str) -> List[int]:
        """The ids written in `text`, separated by single spaces."""
        if not text:
            return []
        ids = []
        for piece in text.split(" "):
            try:
                token = int(piece)
            except ValueError:
                raise ValueError(
                    f"--tokenizer-type NullTokenizer reads a text as integer ids separated by "
                    f"single spaces, and {piece[:40]!r} is not one; give such text or choose "
                    "another --tokenizer-type"
                ) from None
            if not 0 <= token < self._vocab_size:
                raise ValueError(
                    f"--tokenizer-type NullTokenizer: id {token} in the text is outside "
                    f"--vocab-size {self._vocab_size} (ids 0..{self._vocab_size - 1}); give a "
                    "larger --vocab-size"
                )
            ids.append(token)
        return ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """The ids of each text."""
        return [self.tokenize(text) for text in texts]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """The ids as text, separated by single spaces."""
        return " ".join(str(int(token)) for token in token_ids)
