"""tools/generate.py end to end on a checkpoint pretrain_gpt.py writes: greedy completions are
the checkpoint's model's argmax chain, sampling is reproducible by seed, the checkpoint's
tokenizer files can be replaced, and each wrong input is one `error:` line with exit 1."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import pretrain_gpt
from gpt_pretraining import generate_text
from gpt_pretraining.checkpoint_model import read_checkpoint_model
from megatron.tokenizer import build_tokenizer
from tests.sample_data import EOD, MERGES, VOCAB
from tests.tiny_gpt import tiny_gpt_args

PROMPTS = ["The city of", "In 1995, scientists"]


@pytest.fixture(scope="module")
def checkpoint(data_prefix, tmp_path_factory):
    """A 2-layer GPT trained 3 iterations, whose saved tokenizer paths are its own copies (so
    a test can move them away)."""
    directory = tmp_path_factory.mktemp("generate")
    vocab, merges = directory / "vocab.json", directory / "merges.txt"
    shutil.copyfile(VOCAB, vocab)
    shutil.copyfile(MERGES, merges)
    args = tiny_gpt_args(
        data_prefix, "--save", str(directory / "checkpoints"), "--save-interval", "3",
        "--vocab-file", str(vocab), "--merge-file", str(merges),
        hidden_size=32, seq_length=32, train_iters=3,
    )  # fmt: skip
    pretrain_gpt.main(args)
    return directory


def run(argv, capsys):
    """(exit code, stdout, stderr) of tools/generate.py with `argv`."""
    capsys.readouterr()
    try:
        code = generate_text.main(argv)
    except SystemExit as exit_info:  # argparse's errors
        code = exit_info.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def json_lines(out):
    return [json.loads(line) for line in out.splitlines()]


def test_greedy_completions_are_the_models_argmax_chain(checkpoint, capsys):
    load = str(checkpoint / "checkpoints")
    # On the CPU in fp32 also where there is a GPU: compared with the fp32 model below.
    argv = ["--load", load, "--device", "cpu", "--tokens-to-generate", "8", "--greedy", "--json"]
    code, out, err = run(argv + [flag for p in PROMPTS for flag in ("--prompt", p)], capsys)
    assert code == 0, err
    assert "decode steps: eager" in err
    records = json_lines(out)
    assert [record["prompt"] for record in records] == PROMPTS

    model = read_checkpoint_model(load, print_fn=lambda line: None).build_model()
    tokenizer = build_tokenizer("GPT2BPETokenizer", str(VOCAB), str(MERGES))
    for record in records:
        sequence = tokenizer.tokenize(record["prompt"])
        expected = []
        with torch.no_grad():
            while len(expected) < 8:
                token = int(model(torch.tensor([sequence]))[0, -1, : tokenizer.vocab_size].argmax())
                if token == EOD:
                    break
                expected.append(token)
                sequence.append(token)
        assert record["tokens"] == expected
        assert record["completion"] == tokenizer.detokenize(expected)

    # Text output: each prompt followed by its completion; one prompt per batch, same result.
    code, out, _ = run(argv[:-1] + ["--prompt", PROMPTS[0], "--batch-size", "1"], capsys)
    assert code == 0 and out == PROMPTS[0] + records[0]["completion"] + "\n"


def test_sampling_is_reproducible_from_a_prompts_file(checkpoint, tmp_path, capsys):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(PROMPTS) + "\n\n")  # blank lines are not prompts
    argv = ["--load", str(checkpoint / "checkpoints"), "--prompts-file", str(prompts_file),
            "--tokens-to-generate", "6", "--top-p", "0.9", "--temperature", "1.2", "--json"]  # fmt: skip
    first = json_lines(run(argv + ["--seed", "5"], capsys)[1])
    assert len(first) == 2
    assert json_lines(run(argv + ["--seed", "5"], capsys)[1]) == first
    assert json_lines(run(argv + ["--seed", "6"], capsys)[1]) != first


def test_moved_tokenizer_files_are_named_and_can_be_replaced(checkpoint, capsys):
    moved = checkpoint / "moved"
    moved.mkdir()
    names = ("vocab.json", "merges.txt")
    for name in names:
        shutil.move(checkpoint / name, moved / name)
    argv = ["--load", str(checkpoint / "checkpoints"), "--prompt", "Hi", "--greedy",
            "--tokens-to-generate", "2"]  # fmt: skip
    try:
        code, _, err = run(argv, capsys)
        assert code == 1
        assert err.strip().splitlines()[-1] == (
            f"error: the checkpoint's --vocab-file {checkpoint / 'vocab.json'} does not exist "
            "here (saved as the training run named it, maybe relative to another directory); "
            "pass --vocab-file with the file"
        )
        replaced = ["--vocab-file", str(moved / names[0]), "--merge-file", str(moved / names[1])]
        code, out, err = run(argv + replaced, capsys)
        assert code == 0 and out.startswith("Hi"), err
    finally:
        for name in names:
            shutil.move(moved / name, checkpoint / name)
        moved.rmdir()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--load", "{tmp}/none"], "--load {tmp}/none is not a directory"),
        (["--prompts-file", "{tmp}/missing.txt"], "--prompts-file {tmp}/missing.txt: cannot read"),
        (["--top-p", "1.5"], "--top-p 1.5 is out of range; use a value in [0, 1]"),
        (["--greedy", "--top-k", "5"], "--greedy takes the likeliest token: drop --top-k"),
        (["--tokens-to-generate", "40"], "the model has max_position_embeddings=32"),
        (["--device", "tpu:0"], "--device tpu:0"),
        (["--batch-size", "0"], "--batch-size 0 must be >= 1"),
        (["--top-k", "many"], "argument --top-k: invalid int value: 'many'"),
    ],
)
def test_wrong_inputs_are_one_error_line(checkpoint, tmp_path, capsys, flags, message):
    flags = [flag.format(tmp=tmp_path) for flag in flags]
    base = ["--load", str(checkpoint / "checkpoints")]
    if "--prompts-file" not in flags:
        base += ["--prompt", "Hello"]
    code, _, err = run(base + flags, capsys)
    assert code == 1
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message.format(tmp=tmp_path) in errors[0], err
