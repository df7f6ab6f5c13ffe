"""tools/evaluate.py: the loss of a checkpoint on a dataset equals the validation loss its
training run logged for the same samples, and the loss computed by hand from the checkpoint's
model and the samples training builds, for a dense GPT in both checkpoint formats and for a
dMoE GPT; every error is one `error:` line naming the flag."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pretrain_gpt
from gpt_pretraining.checkpoint_format import main as convert
from gpt_pretraining.checkpoint_model import read_checkpoint_model
from gpt_pretraining.evaluation import main as evaluate
from megatron.data.gpt_dataset import build_dataset, build_train_valid_test_datasets
from megatron.data.indexed_dataset import MMapIndexedDataset
from tests.sample_data import EOD
from tests.tiny_gpt import MOE_ARGS, tiny_gpt_args

SPLIT = "949,50,1"  # tiny_gpt_args's
SEQ_LENGTH = 64
SEED = 1234
# Training evaluates --eval-iters 2 global batches of 8 (2 micro-batches of 4): 16 samples, 4
# micro-batches; at iteration 3 (--eval-interval 3) and again, on the next 16, at the end.
TRAINING = dict(train_iters=3, eval_interval=3, eval_iters=2, micro_batch=4, global_batch=8)


def train(data_prefix: str, save: Path, *extra: str):
    """A tiny run of 3 iterations saved under `save`; its TrainingResult."""
    args = tiny_gpt_args(
        data_prefix, "--save", str(save), "--save-interval", "3", *extra, **TRAINING
    )
    return pretrain_gpt.main(args)


@pytest.fixture(scope="module")
def dense_run(data_prefix, tmp_path_factory):
    directory = tmp_path_factory.mktemp("evaluate_dense")
    result = train(data_prefix, directory / "torch_dist")
    return directory, result


@pytest.fixture(scope="module")
def dmoe_run(data_prefix, tmp_path_factory):
    directory = tmp_path_factory.mktemp("evaluate_dmoe")
    result = train(data_prefix, directory / "torch", *MOE_ARGS, "--ckpt-format", "torch")
    return directory, result


def run_tool(load: Path, data_prefix: str, tmp_path: Path, *flags: str) -> Dict[str, Any]:
    """tools/evaluate.py's --output-json for `flags`, after checking it succeeded."""
    output = tmp_path / "evaluation.json"
    assert evaluate(["--load", str(load), "--data-path", data_prefix, *flags,
                     "--output-json", str(output)]) == 0  # fmt: skip
    return json.loads(output.read_text())


def validation_loss(result, prefix: str) -> float:
    return dict(result.validation)[prefix]["lm loss"]


def assert_relative(actual: float, expected: float, tolerance: float = 1e-6) -> None:
    assert abs(actual - expected) <= tolerance * abs(expected), (actual, expected)


def loss_by_hand(load: Path, samples: List[np.ndarray], eod: Optional[int] = None):
    """(token-weighted mean loss, tokens) of the checkpoint's model over `samples` of
    seq_length + 1 tokens, from its logits, in one batch; with `eod`, inputs equal to it are
    left out (Megatron's --eod-mask-loss)."""
    model = read_checkpoint_model(str(load), print_fn=lambda line: None).build_model()
    text = torch.from_numpy(np.stack(samples)).long()
    tokens, labels = text[:, :-1], text[:, 1:]
    with torch.no_grad():
        logits = model(tokens).float()
    losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    keep = torch.ones_like(losses) if eod is None else (tokens.flatten() != eod).float()
    return (losses.double() * keep).sum().item() / keep.sum().item(), int(keep.sum())


def training_samples(data_prefix: str, split_name: str, count: Optional[int] = None):
    """The first `count` (all: None) samples pretrain_gpt.py's datasets serve of a split of
    SPLIT, for as few samples as it is asked here (one epoch)."""
    datasets = build_train_valid_test_datasets([data_prefix], SPLIT, [0, 0, 0], SEQ_LENGTH, SEED)
    dataset = dict(zip(("train", "valid", "test"), datasets))[split_name]
    return [dataset[index]["text"] for index in range(count or len(dataset))]


def test_the_loss_is_the_training_runs_validation_loss(dense_run, data_prefix, tmp_path, capsys):
    directory, result = dense_run
    load = directory / "torch_dist"
    first = validation_loss(result, "iteration 3")  # samples 0-15 of the valid split
    second = validation_loss(result, "the end of training for val data")  # samples 16-31
    capsys.readouterr()
    evaluation = run_tool(
        load, data_prefix, tmp_path, "--eval-iters", "4", "--micro-batch-size", "4"
    )
    assert_relative(evaluation["lm_loss"], first)
    assert (evaluation["samples"], evaluation["tokens"]) == (16, 16 * SEQ_LENGTH)
    line = re.search(r"^ validation loss on (.*) \| lm loss value: (\S+) \| lm loss PPL: (\S+) \| "
                     r"tokens: (\d+) \|$", capsys.readouterr().out, re.MULTILINE)  # fmt: skip
    assert line is not None
    assert line.group(1) == f"{data_prefix} (valid split of {SPLIT})"
    assert float(line.group(2)) == float(f"{evaluation['lm_loss']:.6E}")
    assert float(line.group(3)) == float(f"{math.exp(evaluation['lm_loss']):.6E}")
    assert int(line.group(4)) == 16 * SEQ_LENGTH

    # Both validations hold as many tokens, so the mean over all 32 samples is theirs; the
    # micro-batch size does not change a dense model's per-token losses.
    both = run_tool(load, data_prefix, tmp_path, "--eval-iters", "4", "--micro-batch-size", "8")
    assert_relative(both["lm_loss"], (first + second) / 2)


def test_torch_and_torch_dist_checkpoints_give_the_loss_computed_by_hand(
    dense_run, data_prefix, tmp_path
):
    directory, _ = dense_run
    sharded = directory / "torch_dist"
    single = tmp_path / "torch"
    assert convert(["--load", str(sharded), "--save", str(single), "--ckpt-format", "torch"]) == 0
    flags = ("--eval-iters", "3", "--micro-batch-size", "4")
    from_sharded = run_tool(sharded, data_prefix, tmp_path, *flags)
    from_single = run_tool(single, data_prefix, tmp_path, *flags)
    assert from_single["lm_loss"] == from_sharded["lm_loss"]
    loss, tokens = loss_by_hand(single, training_samples(data_prefix, "valid", 12))
    assert_relative(from_single["lm_loss"], loss)
    assert from_single["tokens"] == tokens


def test_a_dmoe_checkpoint_gives_its_validation_loss_and_the_loss_by_hand(
    dmoe_run, data_prefix, tmp_path
):
    directory, result = dmoe_run
    load = directory / "torch"
    evaluation = run_tool(
        load, data_prefix, tmp_path, "--eval-iters", "4", "--micro-batch-size", "4"
    )
    assert_relative(evaluation["lm_loss"], validation_loss(result, "iteration 3"))
    loss, _ = loss_by_hand(load, training_samples(data_prefix, "valid", 16))
    assert_relative(evaluation["lm_loss"], loss)


def test_without_eval_iters_every_sample_of_the_split_is_evaluated_once(
    dense_run, data_prefix, tmp_path
):
    """The test split (one document): (tokens - 1) // seq_length samples, the last micro-batch
    partial (3 + 3 + 2)."""
    directory, _ = dense_run
    evaluation = run_tool(directory / "torch_dist", data_prefix, tmp_path,
                          "--split-name", "test", "--micro-batch-size", "3")  # fmt: skip
    document_tokens = int(MMapIndexedDataset(data_prefix).sizes[-1])
    assert evaluation["samples"] == (document_tokens - 1) // SEQ_LENGTH == 8
    loss, tokens = loss_by_hand(directory / "torch_dist", training_samples(data_prefix, "test"))
    assert evaluation["tokens"] == tokens == 8 * SEQ_LENGTH
    assert_relative(evaluation["lm_loss"], loss)


def test_whole_dataset_evaluates_the_samples_of_every_document(
    dense_run, data_prefix, tmp_path, capsys
):
    directory, _ = dense_run
    capsys.readouterr()
    evaluation = run_tool(directory / "torch_dist", data_prefix, tmp_path,
                          "--whole-dataset", "--eval-iters", "2", "--micro-batch-size", "4")  # fmt: skip
    total = int(MMapIndexedDataset(data_prefix).sizes.sum(dtype=np.int64))
    assert f"8 of {(total - 1) // SEQ_LENGTH} samples" in capsys.readouterr().out
    assert evaluation["split"] is None
    # The samples of a --valid-data-path dataset: every document, one epoch.
    dataset = build_dataset("valid", [data_prefix], 0, SEQ_LENGTH, SEED)
    loss, _ = loss_by_hand(directory / "torch_dist", [dataset[index]["text"] for index in range(8)])
    assert_relative(evaluation["lm_loss"], loss)


def test_eod_mask_loss_leaves_the_end_of_document_tokens_out(dense_run, data_prefix, tmp_path):
    directory, _ = dense_run
    load = directory / "torch_dist"
    evaluation = run_tool(load, data_prefix, tmp_path, "--eval-iters", "4", "--eod-mask-loss")
    samples = training_samples(data_prefix, "valid", 16)
    loss, tokens = loss_by_hand(load, samples, eod=EOD)
    assert tokens < 16 * SEQ_LENGTH  # the 16 samples do hold ends of documents
    assert evaluation["tokens"] == tokens
    assert_relative(evaluation["lm_loss"], loss)


def test_bf16_runs_under_autocast_close_to_fp32(dense_run, data_prefix, tmp_path):
    directory, _ = dense_run
    flags = ("--eval-iters", "2", "--micro-batch-size", "4")
    fp32 = run_tool(directory / "torch_dist", data_prefix, tmp_path, *flags)
    bf16 = run_tool(directory / "torch_dist", data_prefix, tmp_path, *flags, "--bf16")
    assert bf16["bf16"] and bf16["lm_loss"] != fp32["lm_loss"]
    assert_relative(bf16["lm_loss"], fp32["lm_loss"], tolerance=1e-2)


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--load", "{missing}"], "--load {missing}: no such directory"),
        (["--load", "{empty}"], "--load {empty} holds no latest_checkpointed_iteration.txt"),
        (["--data-path", "{missing}"], "--data-path {missing}: index file"),
        (
            ["--seq-length", "128"],
            "--seq-length 128 is larger than the checkpoint's --max-position-embeddings 64",
        ),  # fmt: skip
        (["--eval-iters", "1000"], "--eval-iters 1000 x --micro-batch-size 4 asks for 4000"),
        (["--split", "100,0,0"], "(valid split of --split 100,0,0): no documents"),
        (["--eod-mask-loss", "--vocab-file", "{missing}"], "--vocab-file {missing} does not exist"),
        (["--device", "nonsense"], "--device nonsense:"),
        (["--micro-batch-size", "0"], "--micro-batch-size 0 must be at least 1"),
        (["--seq-length", "0"], "--seq-length 0 must be at least 1"),
        (["--output-json", "{missing}/out.json"], "--output-json {missing}/out.json: directory"),
    ],
)
def test_errors_are_one_line_naming_the_flag(
    dense_run, data_prefix, tmp_path, capsys, flags, expected
):
    directory, _ = dense_run
    names = {"missing": str(tmp_path / "missing"), "empty": str(tmp_path)}
    argv = ["--load", str(directory / "torch_dist"), "--data-path", data_prefix]
    argv += [flag.format(**names) for flag in flags]  # a repeated flag: the last one wins
    capsys.readouterr()
    assert evaluate(argv) == 1
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and "\n" not in error, error
    assert expected.format(**names) in error, error


def test_whole_dataset_refuses_a_split(dense_run, data_prefix):
    directory, _ = dense_run
    with pytest.raises(SystemExit) as exit_info:
        evaluate(["--load", str(directory / "torch_dist"), "--data-path", data_prefix,
                  "--whole-dataset", "--split-name", "test"])  # fmt: skip
    assert exit_info.value.code == 2
