"""Megatron-Core's tokenizer types: GPT-2 BPE, SentencePiece, Hugging Face tokenizer.json,
tiktoken JSON vocabularies and the file-less NullTokenizer (megatron.tokenizer.flags)."""

from megatron.tokenizer.build import (
    MegatronTokenizer,
    build_tokenizer,
    build_tokenizer_from_flags,
    disable_tokenizers_parallelism,
    vocab_size_with_padding,
)
from megatron.tokenizer.flags import TOKENIZER_TYPES, TokenizerFlags
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.tokenizer.huggingface_tokenizer import HuggingFaceTokenizer
from megatron.tokenizer.null_tokenizer import NullTokenizer
from megatron.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer
from megatron.tokenizer.tiktoken_tokenizer import TikTokenizer

__all__ = [
    "TOKENIZER_TYPES",
    "MegatronTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "TikTokenizer",
    "TokenizerFlags",
    "build_tokenizer",
    "build_tokenizer_from_flags",
    "disable_tokenizers_parallelism",
    "vocab_size_with_padding",
]
