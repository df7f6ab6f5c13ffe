"""The tokenizer a checkpoint's saved arguments name, for Megatron-Core's types: the saved flags
build it again (NullTokenizer from --vocab-size alone), a saved file that moved is named."""

from __future__ import annotations

import argparse

import pytest

from gpt_pretraining.checkpoint_model import checkpoint_tokenizer
from megatron.errors import UserError
from megatron.tokenizer import NullTokenizer


def test_a_null_tokenizer_checkpoint_needs_no_file():
    tokenizer = checkpoint_tokenizer(
        argparse.Namespace(tokenizer_type="NullTokenizer", vocab_size=64)
    )
    assert isinstance(tokenizer, NullTokenizer) and tokenizer.eod == 63


@pytest.mark.parametrize("tokenizer_type", ["Llama2Tokenizer", "TikTokenizer"])
def test_a_moved_tokenizer_model_is_named_with_the_flag_that_replaces_it(tmp_path, tokenizer_type):
    moved = str(tmp_path / "tokenizer.file")
    saved = argparse.Namespace(tokenizer_type=tokenizer_type, tokenizer_model=moved)
    with pytest.raises(UserError) as error:
        checkpoint_tokenizer(saved)
    assert str(error.value).startswith(f"the checkpoint's --tokenizer-model {moved} does not exist")
