"""Megatron-compatible tokenizers: GPT-2 BPE, SentencePiece and Hugging Face tokenizer.json."""

from megatron.tokenizer.build import (
    TOKENIZER_TYPES,
    MegatronTokenizer,
    build_tokenizer,
    disable_tokenizers_parallelism,
    vocab_size_with_padding,
)
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.tokenizer.huggingface_tokenizer import HuggingFaceTokenizer
from megatron.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer

__all__ = [
    "TOKENIZER_TYPES",
    "MegatronTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "SentencePieceTokenizer",
    "build_tokenizer",
    "disable_tokenizers_parallelism",
    "vocab_size_with_padding",
]
