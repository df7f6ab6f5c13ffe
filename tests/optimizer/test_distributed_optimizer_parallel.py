"""--use-distributed-optimizer with tensor, pipeline and expert parallelism: pretrain_gpt.py's
trainer in 4 gloo processes (tiny GPT, fp32, 5 steps) gives the single-process lm loss, grad
norm and final parameters (at TP=2 x DP=2 and EP=2 x DP=4 with --overlap-grad-reduce and
--overlap-param-gather, where no step issues a collective behind its parameter all-gather); a
checkpoint saved at TP=2 x DP=2 with it (sharded, written in the background with --async-save,
its gradients reduced during the backward) resumes in one process without it, and a single-process one at
TP=2 x DP=2 with it.

The trainer runs inside `run_distributed`'s forked ranks (pretrain_gpt.main joins the existing
gloo group) rather than under torchrun, which would import torch again in every rank.
"""

from __future__ import annotations

import inspect
import os
import re
import shutil
from pathlib import Path
from typing import Callable, Dict, List, Set, Tuple

import pytest
import torch
import torch.distributed as dist

import pretrain_gpt
from megatron.optimizer.param_gather import ParamGather
from tests.launch import run_distributed
from tests.moe.test_expert_parallel_gpt import moe_gpt_args
from tests.parallel.collective_names import COLLECTIVES, replaced_collectives
from tests.parallel.test_tensor_parallel_gpt import gpt_args
from tests.tiny_gpt import saved_state, tensorboard_scalars

ITERATIONS = 5
MEMORY_LINE = re.compile(
    r"over 4 data-parallel ranks \(experts over 2 expert-data-parallel ranks\): optimizer state "
    r"(?P<local>[0-9.]+) MiB on rank 0 .* instead of (?P<unsharded>[0-9.]+) MiB"
)
TOLERANCE = 1e-5  # relative, on the loss and grad norm; absolute on the parameters
# 4 layers (PP=2 interleaves two one-layer chunks per stage), 2 micro-batches per rank at DP=2.
DENSE = ["--num-layers", "4", "--global-batch-size", "8"]
# Buckets of 20,000 parameters (several per run), reduce-scattered during the backward and
# all-gathered during the next forward.
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "20000"]


class _GatherRecord:
    """What `_record_collectives_behind_the_gather` saw in one rank: the collectives issued
    behind a parameter all-gather in flight, and how many gathers were launched in flight."""

    def __init__(self) -> None:
        self.late: List[str] = []
        self.launched = 0


def _record_collectives_behind_the_gather() -> Tuple[_GatherRecord, Callable]:
    """A record, and the replacement of each collective that fills it (for
    `replaced_collectives`), of every collective, by any name the project calls it
    (tests/parallel/collective_names.py), issued on a group whose parameter all-gather is
    still in flight (--overlap-param-gather: launched after the step, waited bucket by bucket
    before the forwards that need it). NCCL runs a group's collectives in order: each would
    wait for the whole gather and, read on the host, hold the next forward behind it, so the
    overlap would be lost. The gathers' own launches are not counted. Patches this rank's
    ParamGather.start to see them."""
    record = _GatherRecord()
    gathers: List[ParamGather] = []
    launching = [False]
    start = ParamGather.start

    def start_in_flight(self) -> None:
        launching[0] = True
        try:
            start(self)
        finally:
            launching[0] = False
        if self not in gathers:
            gathers.append(self)
        record.launched += self.pending()

    def in_flight_groups() -> Set[int]:
        return {
            id(gather.queues[q][b].group or dist.group.WORLD)
            for gather in gathers
            for q, b in gather._in_flight
        }

    def recorded(name, collective):
        signature = inspect.signature(collective)

        def call(*args, **kwargs):
            group = signature.bind(*args, **kwargs).arguments.get("group") or dist.group.WORLD
            if not launching[0] and id(group) in in_flight_groups():
                record.late.append(name)
            return collective(*args, **kwargs)

        return call

    ParamGather.start = start_in_flight
    return record, recorded


def _pretrain(rank: int, world_size: int, args: List[str]) -> Dict:
    # initialize_distributed reads torchrun's variables and joins the group already there.
    os.environ.update(
        WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1"
    )
    record, recorded = _record_collectives_behind_the_gather()  # in this forked rank only
    with replaced_collectives(recorded, COLLECTIVES):
        pretrain_gpt.main(args)
    return {"late": record.late, "launched": record.launched}


def train(
    world_size: int, args: List[str], directory: Path, save_interval: int = ITERATIONS
) -> Dict[str, Dict[int, float]]:
    """Train in `world_size` ranks, saving under `directory / "ckpt"` every `save_interval`
    iterations and at the end; {scalar: {iteration: value}} for "lm loss" and "grad-norm" from
    rank 0's TensorBoard events."""
    tensorboard = directory / "tb"
    args = [*args, "--save", str(directory / "ckpt"), "--save-interval", str(save_interval)]
    args += ["--tensorboard-dir", str(tensorboard)]
    records = run_distributed(_pretrain, world_size, args, timeout_s=120.0)
    late = [record["late"] for record in records]
    assert late == [[]] * world_size, f"collectives issued behind the parameter gather: {late}"
    if "--overlap-param-gather" in args:  # the record above saw gathers in flight
        assert all(record["launched"] > 0 for record in records), records
    return tensorboard_scalars(tensorboard, ("lm loss", "grad-norm"))


def checkpoint(directory: Path, iteration: int) -> Dict:
    return saved_state(directory / "ckpt", iteration)


def assert_same_run(expected: Dict, actual: Dict, iterations=range(1, ITERATIONS + 1)) -> None:
    for name in ("lm loss", "grad-norm"):
        assert sorted(actual[name]) == list(iterations), (name, actual[name])
        for step in iterations:
            assert actual[name][step] == pytest.approx(expected[name][step], rel=TOLERANCE), (
                name,
                step,
                expected[name],
                actual[name],
            )


def assert_layout(directory: Path, **sizes: int) -> None:
    """The run had these sizes (read from its checkpoint's arguments) and sharded its optimizer."""
    args = checkpoint(directory, ITERATIONS)["args"]
    assert args.use_distributed_optimizer
    assert {name: getattr(args, name) for name in sizes} == sizes


def assert_same_checkpoint(expected_directory: Path, directory: Path) -> None:
    """The final parameters and the unsharded optimizer state are the single process's."""
    expected, saved = checkpoint(expected_directory, ITERATIONS), checkpoint(directory, ITERATIONS)
    assert list(saved["model"]) == list(expected["model"])
    for name, tensor in expected["model"].items():
        torch.testing.assert_close(saved["model"][name], tensor, atol=TOLERANCE, rtol=0.0)
    expected_optimizer = expected["optimizer"]["optimizer"]
    saved_optimizer = saved["optimizer"]["optimizer"]
    assert saved_optimizer["param_groups"] == expected_optimizer["param_groups"]
    assert saved_optimizer["state"].keys() == expected_optimizer["state"].keys()
    for index, state in expected_optimizer["state"].items():
        assert saved_optimizer["state"][index].keys() == state.keys()
        for key, value in state.items():
            torch.testing.assert_close(
                saved_optimizer["state"][index][key], value, atol=TOLERANCE, rtol=0.0
            )


@pytest.fixture(scope="module")
def single_dense(data_prefix, tmp_path_factory):
    directory = tmp_path_factory.mktemp("single_dense")
    return directory, train(1, gpt_args(data_prefix, *DENSE), directory, save_interval=3)


@pytest.fixture(scope="module")
def tp2_dp2(data_prefix, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tp2_dp2")
    args = gpt_args(data_prefix, *DENSE, "--sequence-parallel", tensor_parallel=2)
    # Saved in the background: the resumes below read what --async-save wrote.
    # The gradients reduce-scattered in buckets during the last backward, the norms' (summed
    # over the TP group after it) last.
    args += ["--use-distributed-optimizer", "--async-save", *OVERLAP]
    return directory, train(4, args, directory, save_interval=3)


def test_tensor_parallel_distributed_optimizer_matches_one_process(single_dense, tp2_dp2):
    (single_directory, single), (directory, parallel) = single_dense, tp2_dp2
    assert_layout(directory, tensor_model_parallel_size=2, data_parallel_size=2)
    assert_same_run(single, parallel)
    assert_same_checkpoint(single_directory, directory)


def test_pipeline_parallel_distributed_optimizer_matches_one_process(
    single_dense, data_prefix, tmp_path
):
    single_directory, single = single_dense
    # The overlap flags are accepted under a pipeline: its schedule interleaves the micro-
    # batches' backwards, so the reduction waits for the step and the gather for the forwards.
    args = gpt_args(data_prefix, *DENSE, "--use-distributed-optimizer", *OVERLAP)
    args += ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    parallel = train(4, args, tmp_path)
    assert_layout(tmp_path, pipeline_model_parallel_size=2, data_parallel_size=2)
    assert_same_run(single, parallel)
    assert_same_checkpoint(single_directory, tmp_path)


def test_expert_parallel_distributed_optimizer_matches_one_process(data_prefix, tmp_path, capfd):
    """EP=2 x DP=4: expert groups [0, 1] and [2, 3]; the expert weights are sharded over the
    expert-data-parallel groups [0, 2] and [1, 3], the rest over all four ranks."""
    single = train(1, moe_gpt_args(data_prefix), tmp_path / "single")
    args = moe_gpt_args(data_prefix, "--expert-model-parallel-size", "2", "--async-save")
    parallel = train(4, [*args, "--use-distributed-optimizer", *OVERLAP], tmp_path / "ep2")
    assert_layout(tmp_path / "ep2", expert_model_parallel_size=2, data_parallel_size=4)
    assert_same_run(single, parallel)
    assert_same_checkpoint(tmp_path / "single", tmp_path / "ep2")

    # Rank 0's memory line: its own parameters (half of the experts) unsharded, against a
    # quarter of the dense ones and half of its experts; fp32 weights plus Adam's two moments.
    match = MEMORY_LINE.search(capfd.readouterr().out)
    assert match, "no distributed optimizer memory line"
    model = checkpoint(tmp_path / "single", ITERATIONS)["model"]
    experts = sum(tensor.numel() for name, tensor in model.items() if ".experts." in name)
    dense = sum(tensor.numel() for tensor in model.values()) - experts
    mebibytes = 3 * 4 / 1024.0**2
    assert float(match["unsharded"]) == pytest.approx((dense + experts / 2) * mebibytes, abs=0.006)
    assert float(match["local"]) == pytest.approx((dense / 4 + experts / 4) * mebibytes, abs=0.006)


@pytest.mark.parametrize(
    "saved, world_size, extra",
    [
        ("tp2_dp2", 1, []),
        ("single_dense", 4, ["--use-distributed-optimizer", "--sequence-parallel"]),
    ],
    ids=["tp2_dp2_distributed_to_one_process", "one_process_to_tp2_dp2_distributed"],
)
def test_checkpoint_resumes_in_the_other_layout(
    request, single_dense, data_prefix, tmp_path, saved, world_size, extra
):
    """Iteration 3 of one run, loaded in the other layout, continues the uninterrupted run."""
    source, _ = request.getfixturevalue(saved)
    load = tmp_path / "load"
    load.mkdir()
    shutil.copytree(source / "ckpt" / "iter_0000003", load / "iter_0000003")
    (load / "latest_checkpointed_iteration.txt").write_text("3")
    tensor_parallel = 2 if world_size == 4 else 1
    args = gpt_args(data_prefix, *DENSE, "--load", str(load), tensor_parallel=tensor_parallel)
    # One saved RNG state for two data-parallel ranks: the run has no dropout to draw.
    args += ["--no-load-rng"] if world_size == 4 else []
    resumed = train(world_size, [*args, *extra], tmp_path / "resumed")
    assert_same_run(single_dense[1], resumed, iterations=range(4, ITERATIONS + 1))


def test_checkpoint_resumes_bit_exactly_in_the_same_layout(tp2_dp2, data_prefix, tmp_path):
    """TP=2 x DP=2 with the distributed optimizer, resumed from its own (asynchronously
    written, sharded) iteration 3 in the same layout: the same losses and grad norms, bit for
    bit."""
    source, saved_run = tp2_dp2
    load = tmp_path / "load"
    load.mkdir()
    shutil.copytree(source / "ckpt" / "iter_0000003", load / "iter_0000003")
    (load / "latest_checkpointed_iteration.txt").write_text("3")
    args = gpt_args(data_prefix, *DENSE, "--sequence-parallel", "--load", str(load),
                    tensor_parallel=2)  # fmt: skip
    # The same buckets too: they decide each rank's shard, and so the order in which the grad
    # norm's squares are summed.
    resumed = train(4, [*args, "--use-distributed-optimizer", *OVERLAP], tmp_path / "resumed")
    for name in ("lm loss", "grad-norm"):
        assert resumed[name] == {step: saved_run[name][step] for step in (4, 5)}, name
