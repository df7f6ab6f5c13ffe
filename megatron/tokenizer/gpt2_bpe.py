"""GPT-2 byte-level BPE tokenizer on the Rust `tokenizers` library, id-exact with OpenAI's encoder.

Megatron's pure-Python gpt2_tokenization has no special-token handling: the literal text
"<|endoftext|>" inside a document is split and merged like any other text. This tokenizer
keeps that behaviour by registering no added/special tokens with the `tokenizers` pipeline;
`eod` is only the id that data preprocessing appends between documents.

Threads: `tokenize_batch` uses the library's own thread pool (rayon, one thread per core).
Callers that already run one process per core must call
`megatron.tokenizer.disable_tokenizers_parallelism()` (it sets TOKENIZERS_PARALLELISM=false)
before or inside their workers, or each worker would start another pool of that many threads.
"""

from __future__ import annotations

import json
from typing import Dict, List, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from megatron.tokenizer.base import TokenizerBase

EOD_TOKEN = "<|endoftext|>"


def build_gpt2_hf_tokenizer(vocab_file: str, merge_file: str) -> Tokenizer:
    """The `tokenizers` pipeline for GPT-2: BPE model, GPT-2 regex split, byte-level map/decoder."""
    model = models.BPE.from_file(vocab_file, merge_file)
    tokenizer = Tokenizer(model)
    # use_regex=True splits with OpenAI's GPT-2 pattern
    # ('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+) before
    # mapping bytes to the printable characters the vocab is written in.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


class GPT2BPETokenizer(TokenizerBase):
    """GPT-2 BPE tokenizer with Megatron's AbstractTokenizer surface (tokenize, detokenize, eod)."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        self.vocab_file = vocab_file
        self.merge_file = merge_file
        self._tokenizer = build_gpt2_hf_tokenizer(vocab_file, merge_file)
        with open(vocab_file, encoding="utf-8") as handle:
            self._vocab: Dict[str, int] = json.load(handle)
        self._inv_vocab: Dict[int, str] = {index: token for token, index in self._vocab.items()}
        if EOD_TOKEN not in self._vocab:
            raise ValueError(
                f"GPT-2 vocab file {vocab_file} has no {EOD_TOKEN!r} entry; "
                "pass the GPT-2 gpt2-vocab.json (or a vocab that contains it) as --vocab-file"
            )
        self._eod = self._vocab[EOD_TOKEN]

    @property
    def hf_tokenizer(self) -> Tokenizer:
        """The underlying `tokenizers.Tokenizer` (e.g. to save it as tokenizer.json)."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Number of tokens in the vocab file (50,257 for GPT-2), before padding."""
        return len(self._vocab)

    def tokenize(self, text: str) -> List[int]:
        """Token ids of one text."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Token ids of many texts at once (parallel in Rust); equal to tokenize() on each."""
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids`; invalid UTF-8 byte sequences become U+FFFD, as in GPT-2."""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=False)
