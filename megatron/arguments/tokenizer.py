"""Megatron-Core's tokenizer flags, shared by training and tools/preprocess_data.py as in
Megatron-LM (its preprocess_data.py adds the training tokenizer group). What each type needs of
them, and what the types mean: megatron.tokenizer.flags."""

from __future__ import annotations

import argparse

from megatron.tokenizer.flags import (
    TIKTOKEN_DEFAULT_NUM_SPECIAL_TOKENS,
    TIKTOKEN_PATTERNS,
    TOKENIZER_TYPES,
)


def add_tokenizer_args(parser: argparse.ArgumentParser, require_type: bool = False) -> None:
    """The tokenizer group; with `require_type`, --tokenizer-type has no default (the
    preprocessing tool's choice), else pretrain_gpt's GPT2BPETokenizer."""
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument(
        "--tokenizer-type",
        type=str,
        required=require_type,
        default=None if require_type else "GPT2BPETokenizer",
        choices=TOKENIZER_TYPES,
        help="Tokenizer (pretrain_gpt's default is GPT2BPETokenizer); SentencePieceTokenizer, "
        "GPTSentencePieceTokenizer and Llama2Tokenizer are one SentencePiece tokenizer, as in "
        "Megatron-Core.",
    )
    group.add_argument("--vocab-file", type=str, default=None, help="GPT-2 BPE vocab.json.")
    group.add_argument("--merge-file", type=str, default=None, help="GPT-2 BPE merges.txt.")
    group.add_argument(
        "--tokenizer-model",
        type=str,
        default=None,
        help="SentencePiece .model file, a local Hugging Face tokenizer.json or its directory, "
        "or a tiktoken .json vocabulary (TikTokenizer).",
    )
    group.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="Ids of TikTokenizer (special ones included; default 2**17) and of NullTokenizer "
        "(required; its end-of-document id is N - 1); other types take their files' size.",
    )
    group.add_argument(
        "--tiktoken-pattern",
        type=str,
        default=None,
        choices=TIKTOKEN_PATTERNS,
        help="TikTokenizer's split pattern (default v2).",
    )
    group.add_argument(
        "--tiktoken-num-special-tokens",
        type=int,
        default=TIKTOKEN_DEFAULT_NUM_SPECIAL_TOKENS,
        help="TikTokenizer's special-token ids, before the vocabulary's.",
    )
    group.add_argument(
        "--tokenizer-special-tokens",
        "--tiktoken-special-tokens",
        dest="tokenizer_special_tokens",
        type=str,
        nargs="+",
        default=None,
        metavar="TOKEN",
        help="TikTokenizer's named special tokens, ids 0, 1, ... (default <unk> <s> </s> <mask> "
        "<pad> <cls> <sep>; a list must hold these). --tiktoken-special-tokens is Megatron-Core "
        "0.16's name.",
    )
