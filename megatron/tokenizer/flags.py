"""Megatron-Core's tokenizer flags as one value, and what each --tokenizer-type needs of them.

The types and their meanings are Megatron-Core's (megatron/core/tokenizers, the only tokenizer
system of Megatron-LM since Megatron-Core 0.17 and its default since 0.15):

- GPT2BPETokenizer: GPT-2's vocab.json and merges.txt (--vocab-file, --merge-file).
- SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer: one SentencePiece model
  (--tokenizer-model), three names for the same tokenizer: the model's own encoding, nothing
  added per text, its end-of-sentence piece as the end-of-document id.
- HuggingFaceTokenizer: a local tokenizer.json or a directory holding one (--tokenizer-model).
- TikTokenizer: a tiktoken vocabulary in Megatron-Core's JSON form (--tokenizer-model), its
  split pattern (--tiktoken-pattern), special tokens first (--tiktoken-num-special-tokens,
  --tokenizer-special-tokens) and --vocab-size ids in all.
- NullTokenizer: no file; text is integer ids separated by spaces, --vocab-size ids in all.

`TokenizerFlags.check` reads no file: a run can refuse a bad command line before any work.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    *SENTENCEPIECE_TYPES,
    "HuggingFaceTokenizer",
    "TikTokenizer",
    "NullTokenizer",
)
# Megatron-Core's split patterns, byte for byte (the ids depend on them).
TIKTOKEN_PATTERN_V1 = (
    r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)
TIKTOKEN_PATTERN_V2 = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TIKTOKEN_PATTERNS = {"v1": TIKTOKEN_PATTERN_V1, "v2": TIKTOKEN_PATTERN_V2}
# Megatron-Core's TikTokenizer defaults: the v2 pattern, 1000 special-token ids, 2**17 ids in all,
# and these special tokens (every custom list must hold them; `</s>` is the end of a document).
TIKTOKEN_DEFAULT_PATTERN = "v2"
TIKTOKEN_DEFAULT_NUM_SPECIAL_TOKENS = 1000
TIKTOKEN_DEFAULT_VOCAB_SIZE = 2**17
TIKTOKEN_REQUIRED_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")

# What --tokenizer-model is for each type that reads one, for the "needs" line.
_MODEL_FILE = {
    **{name: "a SentencePiece .model file" for name in SENTENCEPIECE_TYPES},
    "HuggingFaceTokenizer": "a local tokenizer.json or a directory holding one",
    "TikTokenizer": "a tiktoken vocabulary .json in Megatron-Core's form",
}


@dataclass(frozen=True)
class TokenizerFlags:
    """The tokenizer flags of a command line (Megatron-Core's names), hashable and picklable."""

    tokenizer_type: str = "GPT2BPETokenizer"
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    vocab_size: Optional[int] = None
    tiktoken_pattern: Optional[str] = None
    tiktoken_num_special_tokens: int = TIKTOKEN_DEFAULT_NUM_SPECIAL_TOKENS
    tokenizer_special_tokens: Optional[Tuple[str, ...]] = None

    def __post_init__(self) -> None:
        if self.tokenizer_special_tokens is not None:
            object.__setattr__(
                self, "tokenizer_special_tokens", tuple(self.tokenizer_special_tokens)
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace, **replacements) -> TokenizerFlags:
        """The flags of a parsed command line or a checkpoint's saved arguments; an attribute
        the namespace lacks (saved before the flag existed) takes its default."""
        values = {
            field.name: getattr(args, field.name, field.default)
            for field in dataclasses.fields(cls)
        }
        values.update(replacements)
        values["tokenizer_type"] = values["tokenizer_type"] or cls.tokenizer_type
        return cls(**values)

    def check(self) -> None:
        """ValueError, one line naming the flag and what to give, when this type cannot be built
        from these flags; reads no file."""
        kind = self.tokenizer_type
        if kind not in TOKENIZER_TYPES:
            raise ValueError(
                f"unknown --tokenizer-type {kind!r}; choose one of {', '.join(TOKENIZER_TYPES)}"
            )
        if kind == "GPT2BPETokenizer":
            missing = [
                flag
                for flag, value in (
                    ("--vocab-file", self.vocab_file),
                    ("--merge-file", self.merge_file),
                )
                if value is None
            ]
            if missing:
                raise ValueError(
                    f"--tokenizer-type {kind} needs {' and '.join(missing)} (GPT-2's vocab.json "
                    "and merges.txt); none was given"
                )
        elif kind in _MODEL_FILE and self.tokenizer_model is None:
            raise ValueError(
                f"--tokenizer-type {kind} needs --tokenizer-model ({_MODEL_FILE[kind]}); "
                "none was given"
            )
        if kind == "NullTokenizer":
            if self.vocab_size is None:
                raise ValueError(
                    "--tokenizer-type NullTokenizer needs --vocab-size N (its ids are 0..N-1, "
                    "the last one ends each document); none was given"
                )
            if self.vocab_size < 1:
                raise ValueError(f"--vocab-size {self.vocab_size} must be at least 1")
        if kind == "TikTokenizer":
            self._check_tiktoken()
        elif self.tokenizer_special_tokens is not None:
            raise ValueError(
                f"--tokenizer-special-tokens is read only with --tokenizer-type TikTokenizer "
                f"here (Megatron-Core would add them to {kind}'s vocabulary, which this project "
                "does not do); drop it"
            )

    @property
    def tiktoken_special_tokens(self) -> Tuple[str, ...]:
        """TikTokenizer's named special tokens (ids 0, 1, ...): the given list or the default."""
        return self.tokenizer_special_tokens or TIKTOKEN_REQUIRED_SPECIAL_TOKENS

    @property
    def tiktoken_vocab_size(self) -> int:
        """TikTokenizer's number of ids, special ones included: --vocab-size or 2**17."""
        return self.vocab_size or TIKTOKEN_DEFAULT_VOCAB_SIZE

    def _check_tiktoken(self) -> None:
        pattern = self.tiktoken_pattern
        if pattern is not None and pattern not in TIKTOKEN_PATTERNS:
            raise ValueError(f"--tiktoken-pattern {pattern}: choose v1 or v2")
        special = self.tiktoken_special_tokens
        repeated = sorted({token for token in special if special.count(token) > 1})
        if repeated:
            raise ValueError(
                f"--tokenizer-special-tokens lists {' '.join(repeated)} more than once; give "
                "each special token once"
            )
        absent = [token for token in TIKTOKEN_REQUIRED_SPECIAL_TOKENS if token not in special]
        if absent:
            raise ValueError(
                f"--tokenizer-special-tokens lacks {' '.join(absent)}: Megatron-Core's "
                f"TikTokenizer needs {' '.join(TIKTOKEN_REQUIRED_SPECIAL_TOKENS)} among them"
            )
        count, vocab_size = self.tiktoken_num_special_tokens, self.tiktoken_vocab_size
        if count < len(special):
            raise ValueError(
                f"--tiktoken-num-special-tokens {count} is fewer than the {len(special)} "
                f"special tokens named; give at least {len(special)}"
            )
        if count >= vocab_size:
            raise ValueError(
                f"--tiktoken-num-special-tokens {count} leaves no id for the vocabulary in "
                f"--vocab-size {vocab_size}; give a --vocab-size above {count}"
            )
