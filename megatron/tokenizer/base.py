"""What every tokenizer shares: Megatron's AbstractTokenizer surface over a vocabulary and an EOD id."""

from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np


class TokenizerBase:
    """Holds `_vocab` (token -> id), `_inv_vocab` (id -> token) and `_eod`, set by subclasses."""

    _vocab: Dict[str, int]
    _inv_vocab: Dict[int, str]
    _eod: int

    @property
    def vocab(self) -> Dict[str, int]:
        """Token string (in the tokenizer's own form, e.g. "Ġthe" or "▁the") to id."""
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        """Id to token string."""
        return self._inv_vocab

    @property
    def eod(self) -> int:
        """Id appended after each document by data preprocessing (`--append-eod`)."""
        return self._eod

    def tokenize_arrays(self, texts: Sequence[str]) -> List[np.ndarray]:
        """Token ids of each text as an integer array (what data preprocessing writes); every
        tokenizer has `tokenize_batch`."""
        return [np.asarray(ids, dtype=np.uint32) for ids in self.tokenize_batch(texts)]
