"""pretrain_gpt.py with expert parallelism on gloo ranks as torchrun starts them (CPU, fp32 dMoE GPT).

Experts sharded over an expert-parallel group give the single-process losses, load-balancing
losses and grad norms (read at full precision from the TensorBoard scalars); the checkpoint
holds the unsharded experts, so a run resumes at another expert-parallel size; bad sizes stop
before any work with a message naming the numbers.

Every run uses a global batch of 8 in micro-batches of 2, so each micro-batch holds the same
samples at any data-parallel size: the load-balancing loss, a function of each micro-batch's
routing, is then the same number as in one process.
"""

from __future__ import annotations

import shutil

import pytest
import torch

import pretrain_gpt
from tests.launch import pretrain_ranks
from tests.tiny_gpt import MOE_ARGS, saved_state, tensorboard_scalars, tiny_gpt_args

ITERATIONS = 5
SCALARS = ("lm loss", "load balancing loss", "grad-norm")
# Relative. Unlike tensor parallelism, expert parallelism splits no large gradient (the
# 50304 x 64 embedding stays whole), so the grad norms agree as closely as the losses.
TOLERANCE = 1e-5


def moe_gpt_args(data_prefix, *extra):
    """The dMoE GPT of these runs: 32-token samples, micro-batches of 2 in a global batch of 8,
    no evaluation."""
    return tiny_gpt_args(
        data_prefix, *MOE_ARGS, *extra,
        seq_length=32, micro_batch=2, global_batch=8, train_iters=ITERATIONS, eval_iters=0,
    )  # fmt: skip


def run(nproc: int, args: list, tensorboard_dir) -> dict:
    return pretrain_ranks(nproc, args, tensorboard_dir, scalars=SCALARS)


def assert_same_run(expected: dict, actual: dict, iterations=range(1, ITERATIONS + 1)):
    for name in SCALARS:
        assert sorted(actual[name]) == list(iterations), (name, actual[name])
        for step in iterations:
            assert actual[name][step] == pytest.approx(expected[name][step], rel=TOLERANCE), (
                name,
                step,
                expected[name],
                actual[name],
            )


def parameter_count_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if "number of parameters" in line)


@pytest.fixture(scope="module")
def single_and_expert_parallel(data_prefix, tmp_path_factory):
    """The single-process run and the EP=2 run (world 2), each saving at iterations 3 and 5."""
    root = tmp_path_factory.mktemp("runs")
    runs = {}
    for name, nproc, extra in (
        ("single", 1, []),
        ("ep2", 2, ["--expert-model-parallel-size", "2"]),
    ):
        save = ["--save", str(root / f"{name}_ckpt"), "--save-interval", "3"]
        runs[name] = run(nproc, moe_gpt_args(data_prefix, *extra, *save), root / f"{name}_tb")
        runs[name]["checkpoints"] = root / f"{name}_ckpt"
        runs[name]["tensorboard"] = root / f"{name}_tb"
    return runs


def test_expert_parallel_matches_single_process(single_and_expert_parallel):
    single, parallel = single_and_expert_parallel["single"], single_and_expert_parallel["ep2"]
    assert "expert-model-parallel size: 2" in parallel["stdout"]
    # The count covers every expert, as in one process; a second line says what a rank holds.
    assert parameter_count_line(parallel["stdout"]) == parameter_count_line(single["stdout"])
    assert "sharded over 2 expert-parallel ranks" in parallel["stdout"]
    assert_same_run(single, parallel)
    # Each iteration line ends with the worst layer's load imbalance over the two ranks.
    imbalances = [
        float(line.split("expert-parallel load imbalance:")[1].split("|")[0])
        for line in parallel["stdout"].splitlines()
        if " iteration " in line and "consumed samples" in line
    ]
    assert len(imbalances) == ITERATIONS and all(1.0 <= value <= 2.0 for value in imbalances)
    assert len(set(imbalances)) > 1, imbalances  # measured, not a constant
    # TensorBoard: the worst layer (the line's number) and every layer.
    names = ["expert-parallel load imbalance"] + [
        f"expert-parallel load imbalance layer {n}" for n in (0, 1)
    ]
    scalars = tensorboard_scalars(parallel["tensorboard"], names)
    worst = scalars["expert-parallel load imbalance"]
    for step, printed in zip(range(1, ITERATIONS + 1), imbalances):
        assert worst[step] == pytest.approx(printed, abs=6e-4)
    for step in range(1, ITERATIONS + 1):
        per_layer = [scalars[name][step] for name in names[1:]]
        assert worst[step] == pytest.approx(max(per_layer))
    assert "expert-parallel load imbalance" not in single["stdout"]
    # The checkpoint holds the unsharded experts, under the keys of a single-process run.
    expected, saved = (saved_state(run["checkpoints"], 5) for run in (single, parallel))
    assert saved["model"].keys() == expected["model"].keys()
    assert saved["model"]["decoder.layers.0.mlp.experts.w1"].shape[0] == 4
    for name, tensor in expected["model"].items():
        torch.testing.assert_close(saved["model"][name], tensor, atol=1e-5, rtol=1e-4)
    for index, state in expected["optimizer"]["optimizer"]["state"].items():
        for key, value in state.items():
            saved_value = saved["optimizer"]["optimizer"]["state"][index][key]
            torch.testing.assert_close(saved_value, value, atol=1e-5, rtol=1e-4)


def test_moe_expert_model_parallelism_is_expert_parallel_size_data_parallel_size(
    single_and_expert_parallel, data_prefix, tmp_path
):
    args = moe_gpt_args(data_prefix, "--moe-expert-model-parallelism")
    flagged = run(2, args, tmp_path / "tb")
    assert "expert-model-parallel size: 2" in flagged["stdout"]
    for name in SCALARS:
        assert flagged[name] == single_and_expert_parallel["ep2"][name], name


def test_two_expert_data_parallel_replicas(single_and_expert_parallel, data_prefix, tmp_path):
    """World 4, EP=2: expert groups [0, 1] and [2, 3], whose expert gradients meet over the
    expert-data-parallel groups [0, 2] and [1, 3]."""
    args = moe_gpt_args(data_prefix, "--expert-model-parallel-size", "2")
    parallel = run(4, args, tmp_path / "tb")
    assert "data-parallel size: 4" in parallel["stdout"]
    assert_same_run(single_and_expert_parallel["single"], parallel)


@pytest.mark.parametrize(
    "saved, resumed, extra, note",
    [
        ("ep2", 1, [], "saved at another expert-parallel size"),
        # Two data-parallel ranks from a one-process checkpoint: one saved RNG state for two
        # ranks, as for any larger data-parallel size (docs/training.md).
        ("single", 2, ["--expert-model-parallel-size", "2", "--no-load-rng"], None),
    ],
    ids=["ep2_to_one_process", "one_process_to_ep2"],
)
def test_checkpoint_resumes_at_another_expert_parallel_size(
    single_and_expert_parallel, data_prefix, tmp_path, saved, resumed, extra, note
):
    """Iteration 3 of one layout, loaded at the other, continues the uninterrupted run."""
    load = tmp_path / "load"
    load.mkdir()
    shutil.copytree(
        single_and_expert_parallel[saved]["checkpoints"] / "iter_0000003",
        load / "iter_0000003",
    )
    (load / "latest_checkpointed_iteration.txt").write_text("3")
    resumed_run = run(
        resumed, moe_gpt_args(data_prefix, "--load", str(load), *extra), tmp_path / "tb"
    )
    if note is not None:
        assert note in resumed_run["stdout"]
    assert_same_run(
        single_and_expert_parallel["single"], resumed_run, iterations=range(4, ITERATIONS + 1)
    )


@pytest.mark.parametrize(
    "world_size, extra, message",
    [
        (
            2,
            "--expert-model-parallel-size 4",
            "--expert-model-parallel-size 4 does not divide the data-parallel size 2",
        ),
        (
            2,
            "--expert-model-parallel-size 2 --moe-num-experts 3",
            "--moe-num-experts 3 is not divisible by the expert parallel size 2",
        ),
        (
            4,
            "--moe-expert-model-parallelism --moe-num-experts 6",
            "--moe-num-experts 6 is not divisible by the expert parallel size 4",
        ),
        (
            2,
            "--moe-expert-model-parallelism --expert-model-parallel-size 2",
            "pass one of them",
        ),
        (
            2,
            "--expert-model-parallel-size 2 --moe-impl reference",
            "--moe-impl reference runs every expert on one rank",
        ),
        (
            2,
            "--expert-model-parallel-size 2 --moe-expert-parallel-chunked-overlap",
            "add --moe-expert-parallel-buffer-factor",
        ),
        (
            2,
            "--moe-expert-parallel-chunked-overlap --moe-expert-parallel-buffer-factor 2",
            "there is none at expert parallel size 1",
        ),
        (
            2,
            "--expert-model-parallel-size 2 --moe-expert-parallel-chunked-overlap --no-moe-dropless",
            "the capacity MoE (--no-moe-dropless) exchanges its slots in one all-to-all",
        ),
        # NaN and inf compare false with any bound: the planner once crashed on both ranks.
        *(
            (
                2,
                f"--expert-model-parallel-size 2 --moe-expert-parallel-buffer-factor {value}",
                f"--moe-expert-parallel-buffer-factor must be a finite number >= 1 (blocks of at least the balanced share), got {value}",
            )
            for value in ("nan", "inf")
        ),
        # Flags that would do nothing in the layout.
        (
            2,
            "--moe-expert-parallel-buffer-factor 1.5",
            "--moe-expert-parallel-buffer-factor 1.5 sizes the blocks of the expert-parallel "
            "exchange, and there is none at expert parallel size 1",
        ),
        (
            2,
            "--expert-model-parallel-size 2 --moe-expert-parallel-buffer-factor 1.5 "
            "--no-moe-dropless",
            "the capacity MoE (--no-moe-dropless) exchanges its fixed slots already",
        ),
        (
            2,
            "--expert-model-parallel-size 2 --moe-expert-parallel-buffer-factor 1.5 "
            "--moe-expert-parallel-comm-chunks 4",
            "--moe-expert-parallel-comm-chunks 4 takes effect only under "
            "--moe-expert-parallel-chunked-overlap",
        ),
        *(
            (
                2,
                f"{layout} --moe-expert-parallel-chunked-overlap --moe-expert-parallel-comm-chunks 1",
                "one chunk leaves nothing to overlap",
            )
            for layout in (
                "",
                "--expert-model-parallel-size 2 --moe-expert-parallel-buffer-factor 2",
            )
        ),
        # 128 routed rows per rank (64 tokens, top-2), 64 per block at factor 1: 8 chunks at most.
        (
            2,
            "--expert-model-parallel-size 2 --moe-expert-parallel-buffer-factor 1 "
            "--moe-expert-parallel-chunked-overlap --moe-expert-parallel-comm-chunks 4096",
            "--moe-expert-parallel-comm-chunks 4096 cuts each expert-parallel block of 64 rows",
        ),
    ],
)
def test_bad_expert_parallel_sizes_stop_before_any_work(
    data_prefix, capsys, monkeypatch, world_size, extra, message
):
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    with pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.main(moe_gpt_args(data_prefix, *extra.split()))
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and message in error, error


def test_capacity_moe_expert_parallel_matches_single_process(data_prefix, tmp_path):
    """MegaBlocks' MoE with capacity factor 1 (assignments dropped) at EP2: the single-process
    losses, load-balancing losses and grad norms (each micro-batch holds the same samples)."""
    capacity = ["--no-moe-dropless", "--moe-capacity-factor", "1.0"]
    single = run(1, moe_gpt_args(data_prefix, *capacity), tmp_path / "single")
    parallel = run(
        2,
        moe_gpt_args(data_prefix, *capacity, "--expert-model-parallel-size", "2"),
        tmp_path / "ep2",
    )
    assert "expert-model-parallel size: 2" in parallel["stdout"]
    assert_same_run(single, parallel)
    # Fixed-size slots are balanced by construction: no imbalance field on the line.
    assert "expert-parallel load imbalance" not in parallel["stdout"]


def test_fixed_size_blocks_match_single_process(single_and_expert_parallel, data_prefix, tmp_path):
    """--moe-expert-parallel-buffer-factor: the dMoE's rows exchanged in fixed-size blocks (no
    host sync) give the single-process run, with the imbalance still on every line; blocks too
    small for a step's routing make it run again with larger ones, still the same run."""
    single = single_and_expert_parallel["single"]
    runs = {}
    for factor, reruns in (("2", False), ("1", True)):
        flags = ["--expert-model-parallel-size", "2", "--moe-expert-parallel-buffer-factor", factor]
        parallel = runs[factor] = run(2, moe_gpt_args(data_prefix, *flags), tmp_path / factor)
        assert_same_run(single, parallel)
        assert parallel["stdout"].count("expert-parallel load imbalance:") == ITERATIONS
        notes = [line for line in parallel["stdout"].splitlines() if "runs again" in line]
        assert bool(notes) == reruns, notes
        if reruns:
            # Once grown, the factor stays: only the first steps can need a rerun.
            assert "the buffer factor grows from 1.0 to" in notes[0]
            assert len(notes) < ITERATIONS
    # The padding rows take part in no computation: blocks of other sizes, the same numbers bit
    # for bit.
    for name in SCALARS:
        assert runs["1"][name] == runs["2"][name], name


def test_fixed_size_blocks_rerun_under_a_pipeline(
    single_and_expert_parallel, data_prefix, tmp_path
):
    """PP2 x EP2 (world 4) with blocks too small at first: every stage runs the step again with
    the pipeline's micro-batches replayed, and the run is still the single-process one."""
    flags = [
        "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
        "--moe-expert-parallel-buffer-factor", "1",
    ]  # fmt: skip
    parallel = run(4, moe_gpt_args(data_prefix, *flags), tmp_path / "tb")
    assert "runs again" in parallel["stdout"]
    assert_same_run(single_and_expert_parallel["single"], parallel)


OVERLAP = ["--moe-expert-parallel-buffer-factor", "1", "--moe-expert-parallel-chunked-overlap"]


@pytest.mark.parametrize(
    "layout",
    [
        "--expert-model-parallel-size 4",
        "--expert-model-parallel-size 2 --use-distributed-optimizer",
        "--pipeline-model-parallel-size 2 --expert-model-parallel-size 2",
        # The vocabulary padded as one process pads it (tiny_gpt_args' tensor_parallel).
        "--tensor-model-parallel-size 2 --expert-model-parallel-size 2 "
        "--make-vocab-size-divisible-by 64",
    ],
    ids=["ep4", "ep2_dp2_distributed_optimizer", "pp2_ep2", "tp2_ep2"],
)
def test_overlapped_exchange_matches_the_exchange_without_it(
    single_and_expert_parallel, data_prefix, tmp_path, layout
):
    """--moe-expert-parallel-chunked-overlap (the fixed-size blocks in two chunks whose all-to-alls
    run under each other's experts) on four ranks, with blocks too small at first, so that the
    first steps run again: the single-process run (which the exchange without the flag gives
    too)."""
    parallel = run(4, moe_gpt_args(data_prefix, *layout.split(), *OVERLAP), tmp_path / "tb")
    assert "runs again" in parallel["stdout"]
    assert_same_run(single_and_expert_parallel["single"], parallel)


def test_overlapped_exchange_resumes_exactly_and_saves_the_same_checkpoint(
    single_and_expert_parallel, data_prefix, tmp_path
):
    """EP2 with the overlap: a checkpoint holds what the exact exchange's run saves (the same
    keys, the single-process tensors), and a run resumed from it continues bit for bit, its
    blocks starting again from the flag's factor (the chunks cut the same rows at any factor)."""
    flags = ["--expert-model-parallel-size", "2", *OVERLAP]
    checkpoints = tmp_path / "checkpoints"
    save = ["--save", str(checkpoints), "--save-interval", "3"]
    whole = run(2, moe_gpt_args(data_prefix, *flags, *save), tmp_path / "whole")
    expected = saved_state(single_and_expert_parallel["ep2"]["checkpoints"], 3)
    saved = saved_state(checkpoints, 3)
    assert saved["model"].keys() == expected["model"].keys()
    for name, tensor in expected["model"].items():
        torch.testing.assert_close(saved["model"][name], tensor, atol=1e-5, rtol=1e-4)
    (checkpoints / "latest_checkpointed_iteration.txt").write_text("3")
    resumed = run(2, moe_gpt_args(data_prefix, *flags, "--load", str(checkpoints)), tmp_path / "r")
    for name in SCALARS:
        assert [resumed[name][step] for step in (4, 5)] == [whole[name][step] for step in (4, 5)]
