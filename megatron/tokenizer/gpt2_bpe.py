"""GPT-2 byte-level BPE tokenizer, id-exact with OpenAI's encoder, on one of two engines.

- `tiktoken` (megatron.tokenizer.gpt2_tiktoken), single-threaded and several times faster,
  when it is installed and the files are GPT-2's published vocabulary and merges;
- otherwise the Rust `tokenizers` library's BPE pipeline (`engine` says which is in use).

Megatron's pure-Python gpt2_tokenization has no special-token handling: the literal text
"<|endoftext|>" inside a document is split and merged like any other text. Both engines keep
that behaviour (no added or special tokens); `eod` is only the id that data preprocessing
appends between documents.

Long texts are encoded in pieces of about `PIECE_CHARACTERS` characters, cut where GPT-2's
split pattern cuts anyway (`safe_cuts`), so a document of any size needs memory for one piece
(and its ids); text with no such cut (a million characters without a space or newline after
a non-space) stays whole.

Threads: with the `tokenizers` engine `tokenize_batch` uses the library's own thread pool (rayon,
one thread per core). Callers that already run one process per core must call
`megatron.tokenizer.disable_tokenizers_parallelism()` (it sets TOKENIZERS_PARALLELISM=false)
before or inside their workers, or each worker would start another pool of that many threads.
"""

from __future__ import annotations

import json
import re
from typing import Dict, Iterator, List, Optional, Sequence

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from megatron.tokenizer.base import TokenizerBase
from megatron.tokenizer.gpt2_tiktoken import EOD_TOKEN, build_tiktoken_gpt2

ENGINES = ("auto", "tiktoken", "tokenizers")
PIECE_CHARACTERS = 1 << 20
# A cut before a space or newline that follows a non-whitespace character: GPT-2's pattern
# ends every match there (no alternative runs from non-whitespace into whitespace) and looks
# only forward, so the pieces split exactly as the whole text does.
_SAFE_CUT = re.compile(r"\S(?=[ \n])")


def safe_cuts(text: str, piece_characters: int = PIECE_CHARACTERS) -> Iterator[str]:
    """`text` in consecutive pieces of about `piece_characters` characters whose GPT-2
    encodings, joined, equal the encoding of `text` (a piece is longer where no cut is near)."""
    start = 0
    while len(text) - start > piece_characters:
        found = _SAFE_CUT.search(text, start + piece_characters)
        if found is None:
            break
        yield text[start : found.end()]
        start = found.end()
    yield text[start:]


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
    """GPT-2 BPE tokenizer with Megatron's AbstractTokenizer surface (tokenize, detokenize, eod).

    `engine`: "auto" takes tiktoken where it applies (module docstring), "tiktoken" insists on
    it (ValueError where it does not apply), "tokenizers" keeps the Rust `tokenizers` pipeline.
    """

    def __init__(self, vocab_file: str, merge_file: str, engine: str = "auto") -> None:
        if engine not in ENGINES:
            raise ValueError(f"engine {engine!r}: choose one of {', '.join(ENGINES)}")
        self.vocab_file = vocab_file
        self.merge_file = merge_file
        with open(vocab_file, encoding="utf-8") as handle:
            self._vocab: Dict[str, int] = json.load(handle)
        self._inv_vocab: Dict[int, str] = {index: token for token, index in self._vocab.items()}
        if EOD_TOKEN not in self._vocab:
            raise ValueError(
                f"GPT-2 vocab file {vocab_file} has no {EOD_TOKEN!r} entry; "
                "pass the GPT-2 gpt2-vocab.json (or a vocab that contains it) as --vocab-file"
            )
        self._eod = self._vocab[EOD_TOKEN]
        self._tiktoken = (
            None
            if engine == "tokenizers"
            else build_tiktoken_gpt2(self._vocab, merge_file, vocab_file)
        )
        if engine == "tiktoken" and self._tiktoken is None:
            raise ValueError(
                f"the tiktoken engine needs tiktoken installed and GPT-2's published vocab and "
                f"merges; {vocab_file} and {merge_file} are not both (use engine 'tokenizers')"
            )
        self._hf: Optional[Tokenizer] = None
        if self._tiktoken is None:
            self._hf = build_gpt2_hf_tokenizer(vocab_file, merge_file)

    @property
    def engine(self) -> str:
        """The library that encodes: "tiktoken" or "tokenizers"."""
        return "tokenizers" if self._tiktoken is None else "tiktoken"

    @property
    def hf_tokenizer(self) -> Tokenizer:
        """The `tokenizers.Tokenizer` of these files (e.g. to save it as tokenizer.json); built
        on first use when tiktoken encodes."""
        if self._hf is None:
            self._hf = build_gpt2_hf_tokenizer(self.vocab_file, self.merge_file)
        return self._hf

    @property
    def vocab_size(self) -> int:
        """Number of tokens in the vocab file (50,257 for GPT-2), before padding."""
        return len(self._vocab)

    def tokenize(self, text: str) -> List[int]:
        """Token ids of one text."""
        if self._tiktoken is not None:
            return self._tiktoken.encode_ordinary(text)
        return self.hf_tokenizer.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Token ids of many texts; equal to tokenize() on each (tiktoken: one thread;
        `tokenizers`: its thread pool)."""
        if self._tiktoken is not None:
            return [self._tiktoken.encode_ordinary(text) for text in texts]
        encodings = self.hf_tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def tokenize_arrays(self, texts: Sequence[str]) -> List[np.ndarray]:
        """Token ids of each text as an integer array, long texts encoded piece by piece."""
        return [self._tokenize_array(text) for text in texts]

    def _tokenize_array(self, text: str) -> np.ndarray:
        pieces = []
        for piece in safe_cuts(text):
            # tiktoken's encode_to_numpy takes its special-token path, slower than this.
            pieces.append(np.asarray(self.tokenize(piece), dtype=np.uint32))
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids`; invalid UTF-8 byte sequences become U+FFFD, as in GPT-2."""
        return self.hf_tokenizer.decode(list(token_ids), skip_special_tokens=False)
