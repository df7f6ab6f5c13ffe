"""What each --tokenizer-type needs of the flags: one line naming the flag, before any file is
read; and one list of the types, which training and preprocessing both offer."""

from __future__ import annotations

import argparse

import pytest

from megatron.arguments import build_parser
from megatron.data.preprocess import build_parser as build_preprocess_parser
from megatron.tokenizer import TOKENIZER_TYPES, TokenizerFlags


def _choices(parser: argparse.ArgumentParser) -> tuple:
    (action,) = [action for action in parser._actions if action.dest == "tokenizer_type"]
    return tuple(action.choices)


def test_training_and_preprocessing_offer_the_one_list_of_types():
    assert _choices(build_parser()) == _choices(build_preprocess_parser()) == TOKENIZER_TYPES
    assert TOKENIZER_TYPES == (
        "GPT2BPETokenizer",
        "SentencePieceTokenizer",
        "GPTSentencePieceTokenizer",
        "Llama2Tokenizer",
        "HuggingFaceTokenizer",
        "TikTokenizer",
        "NullTokenizer",
    )


def test_megatron_core_0_16s_special_tokens_flag_is_the_same_flag():
    for spelling in ("--tokenizer-special-tokens", "--tiktoken-special-tokens"):
        args = build_parser().parse_args([spelling, "<unk>", "<s>"])
        assert TokenizerFlags.from_args(args).tokenizer_special_tokens == ("<unk>", "<s>")


def test_saved_arguments_without_the_newer_flags_take_their_defaults():
    saved = argparse.Namespace(tokenizer_type="SentencePieceTokenizer", tokenizer_model="m.model")
    assert TokenizerFlags.from_args(saved) == TokenizerFlags(
        "SentencePieceTokenizer", tokenizer_model="m.model"
    )
    assert TokenizerFlags.from_args(argparse.Namespace()).tokenizer_type == "GPT2BPETokenizer"


REQUIRED = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            dict(tokenizer_type="GPT2BPETokenizer", merge_file="m.txt"),
            "--tokenizer-type GPT2BPETokenizer needs --vocab-file (GPT-2's vocab.json and "
            "merges.txt); none was given",
        ),
        (
            dict(tokenizer_type="Llama2Tokenizer"),
            "--tokenizer-type Llama2Tokenizer needs --tokenizer-model (a SentencePiece .model "
            "file); none was given",
        ),
        (
            dict(tokenizer_type="TikTokenizer"),
            "--tokenizer-type TikTokenizer needs --tokenizer-model (a tiktoken vocabulary .json "
            "in Megatron-Core's form); none was given",
        ),
        (
            dict(tokenizer_type="NullTokenizer"),
            "--tokenizer-type NullTokenizer needs --vocab-size N (its ids are 0..N-1, the last "
            "one ends each document); none was given",
        ),
        (
            dict(tokenizer_type="NullTokenizer", vocab_size=0),
            "--vocab-size 0 must be at least 1",
        ),
        (
            dict(tokenizer_type="TikTokenizer", tokenizer_model="v.json", tiktoken_pattern="v3"),
            "--tiktoken-pattern v3: choose v1 or v2",
        ),
        (
            dict(
                tokenizer_type="TikTokenizer",
                tokenizer_model="v.json",
                tokenizer_special_tokens=("<unk>", "<s>", "</s>"),
            ),
            "--tokenizer-special-tokens lacks <mask> <pad> <cls> <sep>: Megatron-Core's "
            "TikTokenizer needs <unk> <s> </s> <mask> <pad> <cls> <sep> among them",
        ),
        (
            dict(
                tokenizer_type="TikTokenizer",
                tokenizer_model="v.json",
                tokenizer_special_tokens=(*REQUIRED, "<s>"),
            ),
            "--tokenizer-special-tokens lists <s> more than once; give each special token once",
        ),
        (
            dict(
                tokenizer_type="TikTokenizer",
                tokenizer_model="v.json",
                tiktoken_num_special_tokens=5,
            ),
            "--tiktoken-num-special-tokens 5 is fewer than the 7 special tokens named; give at "
            "least 7",
        ),
        (
            dict(tokenizer_type="TikTokenizer", tokenizer_model="v.json", vocab_size=1000),
            "--tiktoken-num-special-tokens 1000 leaves no id for the vocabulary in --vocab-size "
            "1000; give a --vocab-size above 1000",
        ),
        (
            dict(
                tokenizer_type="HuggingFaceTokenizer",
                tokenizer_model="t.json",
                tokenizer_special_tokens=("<x>",),
            ),
            "--tokenizer-special-tokens is read only with --tokenizer-type TikTokenizer here "
            "(Megatron-Core would add them to HuggingFaceTokenizer's vocabulary, which this "
            "project does not do); drop it",
        ),
        (
            dict(tokenizer_type="BertWordPieceLowerCase"),
            "unknown --tokenizer-type 'BertWordPieceLowerCase'; choose one of "
            + ", ".join(TOKENIZER_TYPES),
        ),
    ],
)
def test_each_bad_combination_is_one_line(flags, line):
    with pytest.raises(ValueError) as error:
        TokenizerFlags(**flags).check()
    assert str(error.value) == line
