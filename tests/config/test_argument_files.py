"""`@FILE` argument files (megatron.arguments.argument_files): the flags in a file configure the
run the same flags on the command line configure; a bad file is one line naming it."""

import pytest

from megatron.config import ConfigError, parse_config
from tests.config.command_lines import MEGABLOCKS_125M

# MEGABLOCKS_125M as a user writes it in a file: several flags a line, comments, quotes.
MODEL_FILE = """\
# the 125M model
--num-layers 12 --hidden-size 768 --num-attention-heads 12   # GPT-2 small
--seq-length 1024 --max-position-embeddings 1024

--init-method-std "0.01" --make-vocab-size-divisible-by 1024 --bf16 --use-flash-attn
"""
REST_FILE = """\
--micro-batch-size 8 --global-batch-size 512
--lr 0.0006 --min-lr 0.00006 --lr-decay-style cosine --lr-warmup-fraction 0.01 --clip-grad 1.0
--split 969,30,1 --train-iters 2000 --lr-decay-iters 2000
--data-path 1.0 pile/01_text_document 1.0 pile/02_text_document
--vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt
--DDP-impl local --no-async-tensor-model-parallel-allreduce
--save-interval 2000 --save ./ckpt --eval-iters 100 --log-interval 100 --eval-interval 1000
"""


def test_flags_from_files_configure_the_command_lines_run(tmp_path, monkeypatch):
    (tmp_path / "model.args").write_text(MODEL_FILE)
    (tmp_path / "run.args").write_text(f"@{tmp_path / 'model.args'}\n{REST_FILE}")
    monkeypatch.chdir(tmp_path)  # a relative @FILE is read from the working directory
    from_files = parse_config(["@run.args"], world_size=8)
    assert from_files == parse_config(MEGABLOCKS_125M, world_size=8)


def test_a_flag_after_the_file_overrides_it(tmp_path):
    (tmp_path / "model.args").write_text(MODEL_FILE)
    rest = REST_FILE.split()
    config = parse_config([f"@{tmp_path / 'model.args'}", *rest, "--num-layers", "4"])
    assert config.model.num_layers == 4


def test_a_missing_argument_file_is_one_line_naming_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as raised:
        parse_config(["@missing.args"])
    assert str(raised.value) == (
        f"argument file @missing.args: {tmp_path / 'missing.args'} is not a file; check the "
        "path (a relative one is read from the working directory)"
    )


def test_an_unclosed_quote_is_one_line_naming_its_line(tmp_path):
    (tmp_path / "bad.args").write_text('--num-layers 2\n--lr "0.1\n')
    with pytest.raises(ConfigError) as raised:
        parse_config([f"@{tmp_path / 'bad.args'}"])
    assert str(raised.value) == (
        "argument file line '--lr \"0.1': No closing quotation; close its quotation"
    )
