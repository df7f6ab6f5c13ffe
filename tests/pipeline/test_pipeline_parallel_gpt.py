"""pretrain_gpt.py with --pipeline-model-parallel-size on gloo ranks as torchrun starts them (CPU, fp32).

Pipeline runs (1F1B and interleaved, alone and with data or tensor parallelism) give the
single-process losses and grad norms read from TensorBoard; bad sizes stop before any work.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

import pretrain_gpt
from tests.launch import pretrain_ranks
from tests.parallel.test_tensor_parallel_gpt import assert_same_run, gpt_args
from tests.tiny_gpt import saved_state

# 4 layers, 4 micro-batches of 2 per step (global batch 8); evaluation (forwards only
# through the pipeline) at iteration 5 and at the end.
PIPELINE_MODEL = ["--num-layers", "4", "--global-batch-size", "8"]
PIPELINE_MODEL += ["--eval-iters", "2", "--eval-interval", "5"]
VALIDATION_PATTERN = re.compile(r"validation loss at (.*?) \| lm loss value: ([0-9.E+-]+)")


def assert_same_validation(expected: dict, actual: dict) -> None:
    expected_losses = VALIDATION_PATTERN.findall(expected["stdout"])
    actual_losses = VALIDATION_PATTERN.findall(actual["stdout"])
    assert len(expected_losses) == 3  # iteration 5, end of training (val and test)
    assert [where for where, _ in actual_losses] == [where for where, _ in expected_losses]
    for (_, value), (_, expected_value) in zip(actual_losses, expected_losses):
        assert float(value) == pytest.approx(float(expected_value), rel=1e-5)


def assert_same_grad_norms(expected: dict, actual: dict) -> None:
    # Summed in float64 on CPU (megatron/optimizer/optimizer.py), so as exact as the loss.
    for step, norm in expected["grad-norm"].items():
        assert actual["grad-norm"][step] == pytest.approx(norm, rel=1e-5)


def saving(directory: Path) -> list:
    return ["--save", str(directory), "--save-interval", "3"]


@pytest.fixture(scope="module")
def single_process(data_prefix, tmp_path_factory):
    root = tmp_path_factory.mktemp("single")
    run = pretrain_ranks(
        1, gpt_args(data_prefix, *PIPELINE_MODEL, *saving(root / "ckpt")), root / "tb"
    )
    return {**run, "checkpoints": root / "ckpt"}


@pytest.fixture(scope="module")
def pipeline_run(data_prefix, tmp_path_factory):
    """PP=2 with the interleaved schedule, saving at iterations 3 and 5 in the background."""
    root = tmp_path_factory.mktemp("pp2")
    args = gpt_args(data_prefix, *PIPELINE_MODEL, *saving(root / "ckpt"), "--async-save")
    args += ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    run = pretrain_ranks(2, args, root / "tb")
    return {**run, "checkpoints": root / "ckpt"}


@pytest.mark.parametrize(
    "nproc, tensor_parallel, extra",
    [
        (2, 1, ""),
        (4, 1, "--num-layers-per-virtual-pipeline-stage 1"),
        (4, 2, ""),
    ],
    ids=["pp2", "pp2_dp2_interleaved", "tp2_pp2"],
)
def test_pipeline_matches_single_process(
    single_process,
    data_prefix,
    tmp_path,
    nproc,
    tensor_parallel,
    extra,
):
    args = gpt_args(data_prefix, *PIPELINE_MODEL, tensor_parallel=tensor_parallel)
    args += ["--pipeline-model-parallel-size", "2", *extra.split()]
    run = pretrain_ranks(nproc, args, tmp_path / "tb")
    assert "pipeline-model-parallel size: 2" in run["stdout"]
    assert len(re.findall(r" iteration +5/", run["stdout"])) == 1  # logged once
    assert_same_run(single_process, run)
    assert_same_validation(single_process, run)
    assert_same_grad_norms(single_process, run)


def test_pipeline_checkpoint_holds_the_single_process_tensors(single_process, pipeline_run):
    """PP=2 interleaved: the single-process run, and a checkpoint a single process wrote."""
    assert_same_run(single_process, pipeline_run)
    assert_same_grad_norms(single_process, pipeline_run)
    assert_same_validation(single_process, pipeline_run)
    expected, saved = (saved_state(run["checkpoints"], 5) for run in (single_process, pipeline_run))
    assert list(saved["model"]) == list(expected["model"])
    for name, tensor in expected["model"].items():
        torch.testing.assert_close(saved["model"][name], tensor, atol=1e-5, rtol=1e-4)
    expected_optimizer = expected["optimizer"]["optimizer"]
    saved_optimizer = saved["optimizer"]["optimizer"]
    assert saved_optimizer["param_groups"] == expected_optimizer["param_groups"]
    for index, state in expected_optimizer["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(
                saved_optimizer["state"][index][key], value, atol=1e-5, rtol=1e-4
            )


@pytest.mark.parametrize(
    "saved, nproc, extra",
    [("pipeline_run", 1, ""), ("single_process", 2, "--pipeline-model-parallel-size 2")],
    ids=["pp2_to_single", "single_to_pp2"],
)
def test_checkpoint_resumes_in_another_pipeline_layout(
    request,
    single_process,
    data_prefix,
    tmp_path,
    saved,
    nproc,
    extra,
):
    """Iteration 3 of one layout, loaded in the other, continues the uninterrupted run."""
    load = tmp_path / "load"
    load.mkdir()
    source = request.getfixturevalue(saved)["checkpoints"]
    shutil.copytree(source / "iter_0000003", load / "iter_0000003")
    (load / "latest_checkpointed_iteration.txt").write_text("3")
    args = gpt_args(data_prefix, *PIPELINE_MODEL, "--load", str(load), *extra.split())
    run = pretrain_ranks(nproc, args, tmp_path / "tb")
    assert_same_run(single_process, run, iterations=range(4, 6))


@pytest.mark.parametrize(
    "world_size, extra, message",
    [
        (
            2,
            "--pipeline-model-parallel-size 2 --num-layers 3",
            "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2",
        ),
        (
            2,
            "--pipeline-model-parallel-size 2 --num-layers 4 "
            "--num-layers-per-virtual-pipeline-stage 3",
            "--num-layers-per-virtual-pipeline-stage 3 does not divide the 2 layers",
        ),
        (
            2,
            "--pipeline-model-parallel-size 2 --num-layers 4 "
            "--num-layers-per-virtual-pipeline-stage 1 --global-batch-size 6",
            "number of micro-batches (3 = --global-batch-size 6",
        ),
    ],
)
def test_bad_pipeline_sizes_stop_before_any_work(
    data_prefix,
    capsys,
    monkeypatch,
    world_size,
    extra,
    message,
):
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    with pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.main(gpt_args(data_prefix, *extra.split()))
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and message in error, error
