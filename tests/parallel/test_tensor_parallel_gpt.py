"""pretrain_gpt.py with --tensor-model-parallel-size on gloo ranks as torchrun starts them (CPU, fp32).

Tensor (and sequence) parallel runs give the single-process losses and grad norms, read at full
precision from the TensorBoard scalars; checkpoints are layout-free, so a run resumes at another
tensor-parallel size; bad sizes stop before any work with a message naming the numbers.

Every tensor-parallel run uses --make-vocab-size-divisible-by 128 / TP: Megatron pads the
vocabulary to a multiple of that value x TP, and the same padded vocabulary (50304) is what
makes the model the same function as the single-process one.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch

import pretrain_gpt
from tests.launch import pretrain_ranks
from tests.tiny_gpt import saved_state, tiny_gpt_args

ITERATIONS = 5


def gpt_args(data_prefix, *extra, dropout=0.0, tensor_parallel=1):
    """The GPT of these runs: 32-token samples, micro-batches of 2 in a global batch of 4,
    no evaluation."""
    return tiny_gpt_args(
        data_prefix, *extra,
        seq_length=32, micro_batch=2, global_batch=4, train_iters=ITERATIONS,
        dropout=dropout, eval_iters=0, tensor_parallel=tensor_parallel,
    )  # fmt: skip


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
        runs[name] = pretrain_ranks(
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
    expected, saved = (saved_state(run["checkpoints"], 5) for run in (single, parallel))
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
    run = pretrain_ranks(nproc, args, tmp_path / "tb")
    assert f"data-parallel size: {nproc // tensor_parallel}" in run["stdout"]
    assert_same_run(single_and_tensor_parallel["single"], run)


def test_dropout_and_recompute_train_under_tensor_parallelism(data_prefix, tmp_path):
    recompute = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
    args = gpt_args(data_prefix, *recompute.split(), dropout=0.1, tensor_parallel=2)
    run = pretrain_ranks(2, args, tmp_path / "tb")
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
    run = pretrain_ranks(resumed, args, tmp_path / "tb")
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
