"""Tokenizer construction from Megatron's flags, and the vocab padding for the embedding table."""

from __future__ import annotations

import os
from typing import Callable, Union

from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.tokenizer.huggingface_tokenizer import HuggingFaceTokenizer
from megatron.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer

MegatronTokenizer = Union[GPT2BPETokenizer, SentencePieceTokenizer, HuggingFaceTokenizer]

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer")


def _require_path(path: str | None, flag: str, tokenizer_type: str, allow_dir: bool = False) -> str:
    """Return `path` if it names an existing file (or directory); else raise naming `flag`."""
    if path is None:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs {flag}; none was given")
    exists = os.path.isfile(path) or (allow_dir and os.path.isdir(path))
    if not exists:
        kind = "file or directory" if allow_dir else "file"
        raise ValueError(
            f"{flag} {path} does not exist (needed by --tokenizer-type {tokenizer_type}); "
            f"pass an existing {kind}"
        )
    return path


def build_tokenizer(
    tokenizer_type: str,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tokenizer_model: str | None = None,
    eod_token: str | None = None,
) -> MegatronTokenizer:
    """Build the tokenizer named by --tokenizer-type from the file flags it needs.

    GPT2BPETokenizer needs --vocab-file and --merge-file; SentencePieceTokenizer needs
    --tokenizer-model (a .model file); HuggingFaceTokenizer needs --tokenizer-model (a
    tokenizer.json or a directory holding one) and optionally `eod_token`.
    """
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(
            _require_path(vocab_file, "--vocab-file", tokenizer_type),
            _require_path(merge_file, "--merge-file", tokenizer_type),
        )
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(
            _require_path(tokenizer_model, "--tokenizer-model", tokenizer_type)
        )
    if tokenizer_type == "HuggingFaceTokenizer":
        path = _require_path(tokenizer_model, "--tokenizer-model", tokenizer_type, allow_dir=True)
        return HuggingFaceTokenizer(path, eod_token=eod_token)
    raise ValueError(
        f"unknown --tokenizer-type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}"
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
