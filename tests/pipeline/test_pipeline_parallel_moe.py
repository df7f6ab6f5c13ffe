"""pretrain_gpt.py with dMoE layers under --pipeline-model-parallel-size (gloo, CPU, fp32).

Each stage holds some of the MoE layers: its share of the auxiliary losses reaches the
optimized loss through its output (megatron.pipeline.schedules.attach_loss) and the log sums
the shares over the stages, so pipeline runs (1F1B, interleaved, with data or expert
parallelism) give the single-process lm loss, load-balancing loss and grad norm, in training
and in validation; checkpoints resume across pipeline layouts.

The load-balancing loss weight is 0.1, large enough that a stage whose auxiliary-loss
gradient went missing (or was scaled wrongly) moves the grad norm well past the tolerance.
The trainer runs inside `run_distributed`'s forked ranks (pretrain_gpt.main joins the existing
gloo group) rather than under torchrun, which would import torch again in every rank.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Dict, List

import pytest
import torch

import pretrain_gpt
from megatron.pipeline.schedules import attach_loss
from tests.launch import run_distributed
from tests.tiny_gpt import MOE_ARGS, saved_state, tensorboard_scalars, tiny_gpt_args

ITERATIONS = 5
TOLERANCE = 1e-5  # relative
PIPELINE = ["--pipeline-model-parallel-size", "2"]
INTERLEAVED = [*PIPELINE, "--num-layers-per-virtual-pipeline-stage", "1"]


def moe_gpt_args(data_prefix, *extra):
    """A 4-layer dMoE GPT of 16-token samples, 4 micro-batches of 2 per step; validation
    (forwards only) at iteration 5 and at the end."""
    return tiny_gpt_args(
        data_prefix, *MOE_ARGS, "--moe-loss-weight", "0.1", *extra,
        num_layers=4, hidden_size=32, seq_length=16, micro_batch=2, global_batch=8,
        train_iters=ITERATIONS, eval_interval=5, eval_iters=1,
    )  # fmt: skip


def _pretrain(rank: int, world_size: int, args: List[str]) -> Dict:
    # initialize_distributed reads torchrun's variables and joins the group already there.
    os.environ.update(
        WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1"
    )
    result = pretrain_gpt.main(args)
    return {
        "losses": result.losses,
        "validation": result.validation,
        "expert-load": result.records.get("expert load", []),
    }


def train(world_size: int, args: List[str], directory: Path, save: bool = False) -> Dict:
    """Rank 0's view of a run: {"losses": [{name: value}] per iteration, "grad-norm":
    {iteration: value} (from TensorBoard), "validation": [(where, {name: value})]}; saving
    under `directory / "ckpt"` at iterations 3 and 5 when `save`."""
    args = [*args, "--tensorboard-dir", str(directory / "tb")]
    if save:
        args += ["--save", str(directory / "ckpt"), "--save-interval", "3"]
    result = run_distributed(_pretrain, world_size, args, timeout_s=120.0)[0]
    result["grad-norm"] = tensorboard_scalars(directory / "tb", ["grad-norm"])["grad-norm"]
    return result


def assert_same_run(expected: Dict, actual: Dict, first_iteration: int = 1) -> None:
    """The reported losses and grad norms of iterations `first_iteration`..5, and the
    validation losses, are the expected run's."""
    iterations = range(first_iteration, ITERATIONS + 1)
    assert sorted(actual["grad-norm"]) == list(iterations)
    for step in iterations:
        want = expected["grad-norm"][step]
        assert actual["grad-norm"][step] == pytest.approx(want, rel=TOLERANCE), step
    # Every MoE layer's tokens per expert, gathered from the stages and summed over the
    # data-parallel ranks: the single process's counts (TensorBoard asks for them).
    assert actual["expert-load"] == expected["expert-load"][first_iteration - 1 :]
    expected_losses = expected["losses"][first_iteration - 1 :]
    assert len(actual["losses"]) == len(expected_losses)
    for step, losses, want in zip(iterations, actual["losses"], expected_losses):
        assert losses.keys() == want.keys() >= {"lm loss", "load balancing loss"}, step
        for name, value in want.items():
            assert losses[name] == pytest.approx(value, rel=TOLERANCE), (name, step)
    assert [where for where, _ in actual["validation"]] == [
        where for where, _ in expected["validation"][-len(actual["validation"]) :]
    ]
    for (_, losses), (_, want) in zip(actual["validation"][::-1], expected["validation"][::-1]):
        assert losses.keys() == want.keys() >= {"lm loss", "load balancing loss"}
        for name, value in want.items():
            assert losses[name] == pytest.approx(value, rel=TOLERANCE), name


def test_attached_loss_gets_the_gradient_a_summed_loss_would():
    weight = torch.tensor([1.0, -2.0], requires_grad=True)
    output = attach_loss(3.0 * weight, 0.25 * weight.square().sum())
    assert torch.equal(output, 3.0 * weight)
    output.backward(torch.ones(2))
    assert torch.equal(weight.grad, 3.0 + 0.25 * 2.0 * weight.detach())


@pytest.fixture(scope="module")
def single_process(data_prefix, tmp_path_factory):
    directory = tmp_path_factory.mktemp("single")
    return directory, train(1, moe_gpt_args(data_prefix), directory, save=True)


@pytest.fixture(scope="module")
def pipeline_run(data_prefix, tmp_path_factory):
    """PP=2 (1F1B), saving at iterations 3 and 5."""
    directory = tmp_path_factory.mktemp("pp2")
    return directory, train(2, moe_gpt_args(data_prefix, *PIPELINE), directory, save=True)


def test_pipeline_matches_single_process(single_process, pipeline_run):
    single = single_process[1]
    # The auxiliary loss matters: 0.1 x a per-layer loss near 1, not a rounding error.
    assert single["losses"][0]["load balancing loss"] > 0.09
    assert len(single["validation"]) == 3  # iteration 5, end of training (val and test)
    assert_same_run(single, pipeline_run[1])


@pytest.mark.parametrize(
    "world_size, extra",
    [
        (2, INTERLEAVED),
        (4, PIPELINE),
        (4, [*INTERLEAVED, "--expert-model-parallel-size", "2"]),
        (4, [*PIPELINE, "--deterministic-mode"]),  # every op of the layout has a deterministic form
    ],
    ids=["pp2_interleaved", "pp2_dp2", "ep2_pp2_interleaved", "pp2_dp2_deterministic"],
)
def test_pipeline_layouts_match_single_process(
    single_process, data_prefix, tmp_path, world_size, extra
):
    assert_same_run(
        single_process[1], train(world_size, moe_gpt_args(data_prefix, *extra), tmp_path)
    )


@pytest.mark.parametrize(
    "saved, world_size, extra",
    [("pipeline_run", 1, []), ("single_process", 2, PIPELINE)],
    ids=["pp2_to_single", "single_to_pp2"],
)
def test_checkpoint_resumes_in_another_pipeline_layout(
    request, single_process, data_prefix, tmp_path, saved, world_size, extra
):
    """Iteration 3 of one layout, loaded in the other, continues the uninterrupted run."""
    source, _ = request.getfixturevalue(saved)
    load = tmp_path / "load"
    load.mkdir()
    shutil.copytree(source / "ckpt" / "iter_0000003", load / "iter_0000003")
    (load / "latest_checkpointed_iteration.txt").write_text("3")
    args = moe_gpt_args(data_prefix, "--load", str(load), *extra)
    assert_same_run(single_process[1], train(world_size, args, tmp_path), first_iteration=4)


def test_every_other_layer_with_z_loss_and_expert_bias(data_prefix, tmp_path):
    """--moe-layer-freq 2 interleaved: rank 0's chunks hold layers 0 and 2, both MoE, rank 1's
    layers 1 and 3, both dense, so the last stage has no auxiliary loss of its own. The router
    z-loss and the expert-bias update (each layer's counts summed over its replicas) come
    along."""
    extra = ["--moe-layer-freq", "2", "--moe-zloss-weight", "0.01"]
    extra += ["--moe-router-bias-update-rate", "0.01"]
    single = train(1, moe_gpt_args(data_prefix, *extra), tmp_path / "single", save=True)
    args = moe_gpt_args(data_prefix, *extra, *INTERLEAVED)
    pipelined = train(2, args, tmp_path / "pp2", save=True)
    assert single["losses"][0]["router z loss"] > 0
    assert_same_run(single, pipelined)
    expected, saved = (saved_state(tmp_path / run / "ckpt", 5) for run in ("single", "pp2"))
    assert list(saved["model"]) == list(expected["model"])
    assert expected["model"]["decoder.layers.2.mlp.router.expert_bias"].abs().sum() > 0
    for name, tensor in expected["model"].items():
        torch.testing.assert_close(saved["model"][name], tensor, atol=1e-5, rtol=0.0)
    expected_state = expected["optimizer"]["optimizer"]["state"]
    saved_optimizer_state = saved["optimizer"]["optimizer"]["state"]
    assert saved_optimizer_state.keys() == expected_state.keys()
    for index, state in expected_state.items():
        for key, value in state.items():
            torch.testing.assert_close(
                saved_optimizer_state[index][key], value, atol=1e-5, rtol=0.0
            )
    # The single process's iteration 3, with its expert biases, continues in the pipeline.
    load = tmp_path / "load"
    load.mkdir()
    shutil.copytree(tmp_path / "single" / "ckpt" / "iter_0000003", load / "iter_0000003")
    (load / "latest_checkpointed_iteration.txt").write_text("3")
    resumed = train(2, [*args, "--load", str(load)], tmp_path / "resumed")
    assert_same_run(single, resumed, first_iteration=4)


# Megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by x TP: half the
# default (128) at TP=2 keeps the single-process embedding shape.
TENSOR_AND_PIPELINE = [
    "--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64", *PIPELINE
]  # fmt: skip


@pytest.fixture(scope="module")
def tensor_pipeline_run(data_prefix, tmp_path_factory):
    """TP=2 x PP=2 on 4 ranks, saving at iterations 3 and 5."""
    directory = tmp_path_factory.mktemp("tp2_pp2")
    args = moe_gpt_args(data_prefix, *TENSOR_AND_PIPELINE)
    return directory, train(4, args, directory, save=True)


def test_tensor_and_pipeline_parallel_matches_single_process(single_process, tensor_pipeline_run):
    assert_same_run(single_process[1], tensor_pipeline_run[1])


@pytest.mark.parametrize(
    "world_size, extra",
    [(1, []), (2, ["--expert-model-parallel-size", "2"])],
    ids=["to_single", "to_ep2"],
)
def test_tensor_pipeline_checkpoint_resumes_in_one_process_and_at_expert_parallel(
    single_process, tensor_pipeline_run, data_prefix, tmp_path, world_size, extra
):
    """Iteration 3 saved at TP=2 x PP=2 continues the uninterrupted run in one process and at
    EP=2 (the experts of the layout-free files sharded over 2 ranks instead of their channels
    over 2 tensor-parallel ranks)."""
    load = tmp_path / "load"
    load.mkdir()
    shutil.copytree(tensor_pipeline_run[0] / "ckpt" / "iter_0000003", load / "iter_0000003")
    (load / "latest_checkpointed_iteration.txt").write_text("3")
    args = moe_gpt_args(data_prefix, "--load", str(load), *extra)
    assert_same_run(single_process[1], train(world_size, args, tmp_path), first_iteration=4)
