"""A Hugging Face `tokenizer.json` loaded with the `tokenizers` library (no `transformers`).

Encoding follows the file's own pipeline, as Megatron's HuggingFaceTokenizer does: its
post-processor may add tokens (e.g. Llama's BOS), and added special tokens written literally
in the text (e.g. "<|endoftext|>" in GPT-2's official tokenizer.json) become their special id.
Use GPT2BPETokenizer for OpenAI-exact GPT-2 ids.

Threads: `tokenize_batch` uses the library's thread pool; see
`megatron.tokenizer.disable_tokenizers_parallelism()` when running one process per core.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Sequence

from tokenizers import Tokenizer

from megatron.tokenizer.base import TokenizerBase

# End-of-text tokens of common model families (GPT-2/Qwen, Llama 3, Llama 2/Mistral, Gemma),
# tried in this order among the file's added special tokens when nothing names the EOD token.
KNOWN_END_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")

TOKENIZER_FILE_NAME = "tokenizer.json"
TOKENIZER_CONFIG_FILE_NAME = "tokenizer_config.json"


def _read_config_eos_token(config_file: str) -> str | None:
    """`eos_token` from a tokenizer_config.json, which stores it as a string or an AddedToken dict."""
    with open(config_file, encoding="utf-8") as handle:
        config = json.load(handle)
    eos_token = config.get("eos_token")
    if isinstance(eos_token, dict):
        eos_token = eos_token.get("content")
    return eos_token if isinstance(eos_token, str) and eos_token else None


class HuggingFaceTokenizer(TokenizerBase):
    """`tokenizer.json` (or a directory holding one) with Megatron's AbstractTokenizer surface.

    `eod` comes from `eod_token`, else `eos_token` in the tokenizer_config.json beside the
    tokenizer.json, else the first of KNOWN_END_TOKENS among the file's added special tokens.
    """

    def __init__(self, path: str, eod_token: str | None = None) -> None:
        if os.path.isdir(path):
            tokenizer_file = os.path.join(path, TOKENIZER_FILE_NAME)
            if not os.path.isfile(tokenizer_file):
                raise ValueError(
                    f"Hugging Face tokenizer directory {path} has no {TOKENIZER_FILE_NAME}; "
                    "pass a directory that contains one (a `transformers` save_pretrained "
                    "output of a fast tokenizer) or the tokenizer.json file itself"
                )
        else:
            tokenizer_file = path
        self.tokenizer_file = tokenizer_file
        self._tokenizer = Tokenizer.from_file(tokenizer_file)
        self._vocab: Dict[str, int] = self._tokenizer.get_vocab(with_added_tokens=True)
        self._inv_vocab: Dict[int, str] = {index: token for token, index in self._vocab.items()}
        self._eod = self._resolve_eod(eod_token)

    def _resolve_eod(self, eod_token: str | None) -> int:
        """Id of the end-of-document token; see the class docstring for the search order."""
        config_file = os.path.join(os.path.dirname(self.tokenizer_file), TOKENIZER_CONFIG_FILE_NAME)
        config_eos_token = (
            _read_config_eos_token(config_file) if os.path.isfile(config_file) else None
        )
        if eod_token is not None:
            source = "eod_token"
        elif config_eos_token is not None:
            eod_token = config_eos_token
            source = f"eos_token in {config_file}"
        else:
            special_tokens = {
                added.content
                for added in self._tokenizer.get_added_tokens_decoder().values()
                if added.special
            }
            eod_token = next((t for t in KNOWN_END_TOKENS if t in special_tokens), None)
            source = "the added special tokens"
            if eod_token is None:
                raise ValueError(
                    f"cannot tell the end-of-document token of {self.tokenizer_file}: no "
                    f"eod_token was given, there is no eos_token in {config_file}, and none of "
                    f"{list(KNOWN_END_TOKENS)} is an added special token; pass "
                    "eod_token='<your end token>' or add \"eos_token\" to that "
                    f"{TOKENIZER_CONFIG_FILE_NAME}"
                )
        eod = self._tokenizer.token_to_id(eod_token)
        if eod is None:
            raise ValueError(
                f"end-of-document token {eod_token!r} (from {source}) is not in the vocab of "
                f"{self.tokenizer_file}; pass an eod_token that the tokenizer knows"
            )
        return eod

    @property
    def vocab_size(self) -> int:
        """Vocab size including added tokens (at least the largest id + 1), before padding."""
        return max(self._tokenizer.get_vocab_size(with_added_tokens=True), max(self._inv_vocab) + 1)

    def tokenize(self, text: str) -> List[int]:
        """Token ids of one text, with whatever the file's post-processor adds."""
        return self._tokenizer.encode(text).ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Token ids of many texts at once (parallel in Rust); equal to tokenize() on each."""
        return [encoding.ids for encoding in self._tokenizer.encode_batch(list(texts))]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids`, special tokens kept."""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=False)
