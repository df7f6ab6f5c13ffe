"""pretrain_gpt.py with --tensor-model-parallel-size under torchrun (gloo, CPU, fp32).

Tensor (and sequence) parallel runs give the single-process losses and grad norms, read at full
precision from the TensorBoard scalars; checkpoints are layout-free, so a run resumes at another
tensor-parallel size; bad sizes stop before any work with a message naming the numbers.

Every tensor-parallel run uses --make-vocab-size-divisible-by 128 / TP: Megatron pads the
vocabulary to a multiple of that value x TP, and the same padded vocabulary (50304) is what
makes the model the same function as the single-process one.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pretrain_gpt
from tests.sample_data import CORPUS, REPO, SAMPLE, gpt2_preprocess_args
from tools import preprocess_data

ITERATIONS = 5


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("owt") / "owt"
    assert preprocess_data.main(gpt2_preprocess_args(CORPUS, prefix)) == 0
    return f"{prefix}_text_document"


def gpt_args(data_prefix, *extra, dropout=0.0, tensor_parallel=1):
    args = [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", str(ITERATIONS), "--lr", "0.003", "--min-lr", "0.0003",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--clip-grad", "1.0",
        "--hidden-dropout", str(dropout), "--attention-dropout", str(dropout),
        "--data-path", data_prefix, "--split", "949,50,1",
        "--vocab-file", str(SAMPLE / "gpt2-vocab.json"),
        "--merge-file", str(SAMPLE / "gpt2-merges.txt"),
        "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0", "--seed", "1234",
        "--tensor-model-parallel-size", str(tensor_parallel),
        "--make-vocab-size-divisible-by", str(128 // tensor_parallel),
    ]  # fmt: skip
    return args + list(extra)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(
    nproc: int, args: list, tensorboard_dir: Path, scalars=("lm loss", "grad-norm")
) -> dict:
    """Run pretrain_gpt.py on `nproc` gloo ranks; its stdout and the per-iteration values of
    the TensorBoard `scalars` rank 0 logged ({name: {iteration: value}})."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    command += ["--master_addr=127.0.0.1", f"--master_port={_free_port()}"]
    command += [str(REPO / "pretrain_gpt.py"), *args, "--tensorboard-dir", str(tensorboard_dir)]
    environment = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    completed = subprocess.run(
        command, capture_output=True, text=True, env=environment, timeout=300
    )
    assert completed.returncode == 0, (completed.stdout + completed.stderr)[-4000:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tensorboard_dir))
    events.Reload()
    return {
        "stdout": completed.stdout,
        **{name: {event.step: event.value for event in events.Scalars(name)} for name in scalars},
    }


# Relative tolerances. (On CPU the clipped grad norm is summed in float64, see
# megatron/optimizer/optimizer.py: in fp32 the norm of the 50304 x 64 embedding gradient alone
# errs by ~6e-5, and a TP run's two half-size shards err differently.)
TOLERANCES = {"lm loss": 1e-5, "grad-norm": 1e-5}


def assert_same_run(expected: dict, actual: dict, iterations=range(1, ITERATIONS + 1)):
    for name, tolerance in TOLERANCES.items():
        assert sorted(actual[name]) == list(iterations), (name, actual[name])
        for step in iterations:
            assert actual[name][step] == pytest.approx(expected[name][step], rel=tolerance), (
                name,
                step,
                expected[name],
                actual[name],
            )


@pytest.fixture(scope="module")
def single_and_tensor_parallel(data_prefix, tmp_path_factory):
    """The single-process run and the TP=2 run, each saving at iterations 3 and 5."""
    root = tmp_path_factory.mktemp("runs")
    runs = {}
    for name, nproc in (("single", 1), ("tp2", 2)):
        save = ["--save", str(root / f"{name}_ckpt"), "--save-interval", "3"]
        runs[name] = torchrun(
            nproc, gpt_args(data_prefix, *save, tensor_parallel=nproc), root / f"{name}_tb"
        )
        runs[name]["checkpoints"] = root / f"{name}_ckpt"
    return runs


def test_tensor_parallel_matches_single_process(single_and_tensor_parallel):
    single, parallel = single_and_tensor_parallel["single"], single_and_tensor_parallel["tp2"]
    assert "tensor-model-parallel size: 2" in parallel["stdout"]
    assert "(new size: 50304)" in parallel["stdout"]  # Megatron's vocabulary padding line
    assert_same_run(single, parallel)
    # The checkpoint holds the full tensors, under the keys of a single-process run.
    files = [
        run["checkpoints"] / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt"
        for run in (single, parallel)
    ]
    expected, saved = (torch.load(path, weights_only=False) for path in files)
    assert saved["model"].keys() == expected["model"].keys()
    for name, tensor in expected["model"].items():
        torch.testing.assert_close(saved["model"][name], tensor, atol=1e-5, rtol=1e-4)
    for index, state in expected["optimizer"]["optimizer"]["state"].items():
        for key, value in state.items():
            assert saved["optimizer"]["optimizer"]["state"][index][key].shape == value.shape


@pytest.mark.parametrize(
    "nproc, tensor_parallel",
    [(2, 2), (4, 2)],
    ids=["tp2_sp", "tp2_dp2_sp"],
)
def test_sequence_parallel_matches_single_process(
    single_and_tensor_parallel, data_prefix, tmp_path, nproc, tensor_parallel
):
    args = gpt_args(data_prefix, "--sequence-parallel", tensor_parallel=tensor_parallel)
    run = torchrun(nproc, args, tmp_path / "tb")
    assert f"data-parallel size: {nproc // tensor_parallel}" in run["stdout"]
    assert_same_run(single_and_tensor_parallel["single"], run)


def test_dropout_and_recompute_train_under_tensor_parallelism(data_prefix, tmp_path):
    recompute = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
    args = gpt_args(data_prefix, *recompute.split(), dropout=0.1, tensor_parallel=2)
    run = torchrun(2, args, tmp_path / "tb")
    losses = [run["lm loss"][step] for step in range(1, ITERATIONS + 1)]
    assert all(math.isfinite(loss) and loss < 12 for loss in losses), losses


@pytest.mark.parametrize("saved, resumed", [("tp2", 1), ("single", 2)])
def test_checkpoint_resumes_at_another_tensor_parallel_size(
    single_and_tensor_parallel, data_prefix, tmp_path, saved, resumed
):
    """Iteration 3 of one layout, loaded at the other, continues the uninterrupted run."""
    load = tmp_path / "load"
    load.mkdir()
    shutil.copytree(
        single_and_tensor_parallel[saved]["checkpoints"] / "iter_0000003",
        load / "iter_0000003",
    )
    (load / "latest_checkpointed_iteration.txt").write_text("3")
    args = gpt_args(data_prefix, "--load", str(load), tensor_parallel=resumed)
    run = torchrun(resumed, args, tmp_path / "tb")
    assert "saved at another tensor-parallel size" in run["stdout"]
    assert_same_run(single_and_tensor_parallel["single"], run, iterations=range(4, 6))


@pytest.mark.parametrize(
    "world_size, extra, message",
    [
        (2, "--tensor-model-parallel-size 3", "world size 2 is not divisible by"),
        (
            4,
            "--tensor-model-parallel-size 4 --num-attention-heads 2",
            "--num-attention-heads 2 is not divisible by --tensor-model-parallel-size 4",
        ),
        (
            2,
            "--tensor-model-parallel-size 2 --group-query-attention --num-query-groups 1",
            "--num-query-groups 1 is not divisible by --tensor-model-parallel-size 2",
        ),
        (
            2,
            "--tensor-model-parallel-size 2 --sequence-parallel --seq-length 31",
            "--seq-length 31 is not divisible by --tensor-model-parallel-size 2",
        ),
    ],
)
def test_bad_sizes_stop_before_any_work(
    data_prefix, capsys, monkeypatch, world_size, extra, message
):
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    with pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.main(gpt_args(data_prefix, *extra.split()))
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and message in error, error
