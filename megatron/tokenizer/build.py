"""Tokenizer construction from Megatron-Core's flags, and the vocab padding for the embedding table."""

from __future__ import annotations

import os
import re
from typing import Callable, Union

from megatron.tokenizer.flags import (
    SENTENCEPIECE_TYPES,
    TIKTOKEN_DEFAULT_PATTERN,
    TokenizerFlags,
)
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.tokenizer.huggingface_tokenizer import HuggingFaceTokenizer
from megatron.tokenizer.null_tokenizer import NullTokenizer
from megatron.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer
from megatron.tokenizer.tiktoken_tokenizer import TikTokenizer

MegatronTokenizer = Union[
    GPT2BPETokenizer, SentencePieceTokenizer, HuggingFaceTokenizer, TikTokenizer, NullTokenizer
]

# A Hugging Face hub id ("meta-llama/Llama-2-7b-hf"): what Megatron-Core's HuggingFaceTokenizer
# would download when no such local path exists.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def _require_path(path: str | None, flag: str, tokenizer_type: str, allow_dir: bool = False) -> str:
    """Return `path` if it names an existing file (or directory); else raise naming `flag`."""
    if path is None:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs {flag}; none was given")
    exists = os.path.isfile(path) or (allow_dir and os.path.isdir(path))
    if exists:
        return path
    if tokenizer_type == "HuggingFaceTokenizer" and _HUB_ID.fullmatch(path):
        raise ValueError(
            f"{flag} {path} is not a local file or directory, and this project does not "
            f"download tokenizers (no network): get a local copy with `huggingface-cli download "
            f"{path} --local-dir DIR` and pass {flag} DIR"
        )
    kind = "file or directory" if allow_dir else "file"
    raise ValueError(
        f"{flag} {path} does not exist (needed by --tokenizer-type {tokenizer_type}); "
        f"pass an existing {kind}"
    )


def build_tokenizer(
    tokenizer_type: str,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tokenizer_model: str | None = None,
    eod_token: str | None = None,
    **options,
) -> MegatronTokenizer:
    """Build the tokenizer named by --tokenizer-type from the flags it needs (the meanings:
    megatron.tokenizer.flags). `options` are TokenizerFlags's other fields (vocab_size,
    tiktoken_pattern, tiktoken_num_special_tokens, tokenizer_special_tokens); `eod_token`
    names HuggingFaceTokenizer's end-of-document token."""
    flags = TokenizerFlags(tokenizer_type, vocab_file, merge_file, tokenizer_model, **options)
    return build_tokenizer_from_flags(flags, eod_token)


def build_tokenizer_from_flags(
    flags: TokenizerFlags, eod_token: str | None = None
) -> MegatronTokenizer:
    """The tokenizer of `flags`; ValueError, one line naming the flag, when a flag is missing
    or bad or a file is absent or unreadable."""
    flags.check()
    kind = flags.tokenizer_type
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(
            _require_path(flags.vocab_file, "--vocab-file", kind),
            _require_path(flags.merge_file, "--merge-file", kind),
        )
    if kind == "NullTokenizer":
        return NullTokenizer(flags.vocab_size)
    allow_dir = kind == "HuggingFaceTokenizer"
    path = _require_path(flags.tokenizer_model, "--tokenizer-model", kind, allow_dir)
    if kind in SENTENCEPIECE_TYPES:
        return SentencePieceTokenizer(path)
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(path, eod_token=eod_token)
    return TikTokenizer(
        path,
        pattern=flags.tiktoken_pattern or TIKTOKEN_DEFAULT_PATTERN,
        vocab_size=flags.tiktoken_vocab_size,
        num_special_tokens=flags.tiktoken_num_special_tokens,
        special_tokens=flags.tiktoken_special_tokens,
    )


def vocab_size_with_padding(
    orig_vocab_size: int,
    make_vocab_size_divisible_by: int,
    tensor_model_parallel_size: int,
    log: Callable[[str], None] | None = print,
) -> int:
    """Round the vocab size up to a multiple of divisible_by * TP size, as Megatron does.

    Padding keeps each tensor-parallel shard of the embedding the same, aligned size; the
    dummy rows are never produced by the tokenizer. Logs Megatron's "padded vocab" line.
    """
    if make_vocab_size_divisible_by < 1 or tensor_model_parallel_size < 1:
        raise ValueError(
            f"--make-vocab-size-divisible-by ({make_vocab_size_divisible_by}) and "
            f"--tensor-model-parallel-size ({tensor_model_parallel_size}) must both be >= 1"
        )
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    padded = -(-orig_vocab_size // multiple) * multiple
    if log is not None:
        log(
            f" > padded vocab (size: {orig_vocab_size}) with {padded - orig_vocab_size} "
            f"dummy tokens (new size: {padded})"
        )
    return padded


def disable_tokenizers_parallelism() -> None:
    """Stop the `tokenizers` library from starting its own thread pool in this process.

    Call it in the parent before starting one-process-per-core workers (the environment is
    inherited) or in each worker's initializer: `encode_batch` reads TOKENIZERS_PARALLELISM on
    every call, and without it each worker would run one Rust thread per core on top of its
    siblings. SentencePieceTokenizer.tokenize_batch is single-threaded already.
    """
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
