"""--use-distributed-optimizer with --bf16: the model computes with bf16 weights, each rank keeps
the fp32 master weights of its shard only, and the post-step all-gather moves bf16
(megatron.parallelize.data_parallel.autocast_cast_parameters says which parameters; the rest,
embeddings, norms and the biases added in fp32, stay fp32).

- What is gathered: every linear layer's and expert's weights in bf16, the rest in fp32, and
  the model's parameters in those dtypes (a tiny dMoE GPT's optimizer step in 2 gloo ranks).
- The run is the one the distributed optimizer gave with fp32 weights, which autocast cast to
  bf16 in every forward: pretrain_gpt.py's trainer in gloo processes (tiny GPT and dMoE, bf16
  autocast on CPU, 10 iterations) gives bit for bit its losses, and its grad norms but for the
  order in which fp32 squares are summed (the shards now split the weights by dtype); also
  where a group is of one rank (one process; the experts of EP2 on 2 ranks), which rounds its
  master weights into the model's without gathering them. The runs do not clip (--clip-grad
  0): a clipped step multiplies its update by that norm, and the last bit of fp32 rounding
  would then grow through Adam's normalisation and the bf16 rounding of the weights into 1e-5
  to 1e-4 of the loss over 20 iterations (dMoE routing flips make it up to 2e-3 of the grad
  norm). The gradient buckets are the default size (one per dtype here): 4 gloo ranks sum a
  gradient in an order that depends on where it lies in its bucket.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from torch import nn

import pretrain_gpt
from megatron.optimizer.sharded_buffer import ShardedBuffer
from megatron.parallel import parallel_state
from megatron.parallelize import data_parallel
from megatron.parallelize.data_parallel_mode import data_parallel_mode
from moe.config import MoEConfig
from moe.experts import Experts
from moe.mlp_spec import MoEMlpSpec
from tests.config.command_lines import config
from tests.launch import run_distributed
from tests.parallel.collective_names import COLLECTIVES, replaced_collectives
from tests.tiny_gpt import (
    MOE_ARGS,
    saved_state,
    sharded_gpt_model,
    tensorboard_scalars,
    tiny_gpt_args,
    tiny_model_config,
)

ITERATIONS = 10
SAVED = 5  # the iteration the reference runs also save, for the resumes
GRAD_NORM_TOLERANCE = 1e-6  # relative: fp32 squares summed in another order
DENSE = ["--num-layers", "2"]
DMOE = ["--num-layers", "2", *MOE_ARGS]
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]
LAYOUTS = {
    "dmoe_one_process": (1, DMOE),
    "dense_dp2": (2, DENSE),
    "dmoe_dp2": (2, DMOE),
    "dmoe_ep2_dp2": (4, [*DMOE, "--expert-model-parallel-size", "2"]),
    "dmoe_ep2_expert_dp1": (2, [*DMOE, "--expert-model-parallel-size", "2"]),
    "tp2_dp2": (4, [*DENSE, "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2_dp2": (4, [*DENSE, "--pipeline-model-parallel-size", "2"]),
}


def _step_gathers(rank: int, world_size: int) -> Dict:
    """One optimizer step of a tiny dMoE GPT under the data-parallel mode of a --bf16
    --use-distributed-optimizer run: the dtype of each parameter by what reads it, and the
    elements every all-gather moved, by dtype."""
    parallel_state.initialize_model_parallel()
    run_config = config("--bf16", "--use-distributed-optimizer", world_size=world_size)
    model = sharded_gpt_model(tiny_model_config(), MoEMlpSpec(MoEConfig(num_experts=4, top_k=2)))
    optimizer = data_parallel_mode(run_config).build_optimizer(model)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    gathered: Dict[str, int] = {}

    def recorded(name, collective):
        def call(output, *args, **kwargs):
            if name.startswith("all_gather"):
                gathered[str(output.dtype)] = gathered.get(str(output.dtype), 0) + output.numel()
            return collective(output, *args, **kwargs)

        return call

    with replaced_collectives(recorded, COLLECTIVES):
        optimizer.step()
    read_by_products = {
        id(param)
        for module in model.modules()
        if type(module) is nn.Linear or isinstance(module, Experts)
        for param in module.parameters(recurse=False)
    }
    dtypes: Dict[str, List[str]] = {"products": [], "other": []}
    for param in model.parameters():
        dtypes["products" if id(param) in read_by_products else "other"].append(str(param.dtype))
    numel = {
        kind: sum(p.numel() for p in model.parameters() if (id(p) in read_by_products) == kind)
        for kind in (True, False)
    }
    return {"gathered": gathered, "dtypes": dtypes, "numel": numel}


def test_the_step_gathers_the_weights_the_products_read_in_bf16():
    result = run_distributed(_step_gathers, 2)[0]
    assert set(result["dtypes"]["products"]) == {"torch.bfloat16"}
    assert set(result["dtypes"]["other"]) == {"torch.float32"}
    # Each flat buffer is padded to an even length: at most one element each.
    gathered, numel = result["gathered"], result["numel"]
    assert 0 <= gathered["torch.bfloat16"] - numel[True] <= 2
    assert 0 <= gathered["torch.float32"] - numel[False] <= 2


def _pretrain(rank: int, world_size: int, args: List[str], fp32_weights: bool) -> Dict:
    """pretrain_gpt.main in this forked rank; the dtypes of the parameter buffers its steps
    brought up to date (`start_all_gather`: the master shard rounded into the buffer, then
    gathered in a group of more than one rank). `fp32_weights`: the distributed optimizer as
    it was before the model's weights were held in the compute dtype (no parameter is, so
    every buffer is fp32 and its own master)."""
    os.environ.update(
        WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1"
    )
    updated: List[str] = []
    start = ShardedBuffer.start_all_gather

    def recorded(self):
        updated.append(str(self.param_buffer.dtype))
        return start(self)

    ShardedBuffer.start_all_gather = recorded  # in this forked rank only
    if fp32_weights:
        data_parallel.autocast_cast_parameters = lambda model: []
    pretrain_gpt.main(args)
    return {"updated": sorted(set(updated))}


def train(world_size: int, args: List[str], directory: Path, fp32_weights: bool) -> Dict:
    """{scalar: {iteration: value}} of rank 0's TensorBoard, and the dtypes of the parameter
    buffers rank 0 updated."""
    args = [*args, "--tensorboard-dir", str(directory / "tb")]
    records = run_distributed(_pretrain, world_size, args, fp32_weights, timeout_s=300.0)
    scalars = tensorboard_scalars(directory / "tb", ("lm loss", "grad-norm"))
    return {**scalars, "updated": records[0]["updated"]}


def _args(data_prefix: str, layout: str, *extra: str) -> List[str]:
    return tiny_gpt_args(
        data_prefix, "--bf16", "--clip-grad", "0.0", *LAYOUTS[layout][1],
        "--use-distributed-optimizer", *extra,
        seq_length=16, micro_batch=1, global_batch=4, train_iters=ITERATIONS, eval_iters=0,
    )  # fmt: skip


@pytest.fixture(scope="module")
def runs(data_prefix, tmp_path_factory):
    """Each run trained once for the module: `run(layout, overlap, fp32_weights)`.

    With fp32 weights the overlap changes when the gradients are summed, and where each lies in
    its bucket (the model's order instead of the optimizer's groups): over 2 ranks a sum is the
    same wherever, over 4 it is not, so only the layouts with 4 data-parallel ranks train a
    reference with the overlap. dense_dp2 without overlap saves iteration SAVED: with fp32
    weights in the torch format, with bf16 weights in torch_dist, written in the background."""
    trained: Dict[tuple, Dict] = {}

    def run(layout: str, overlap: bool, fp32_weights: bool) -> Dict:
        world_size, extra = LAYOUTS[layout]
        if fp32_weights:
            overlap = overlap and _data_parallel_size(world_size, extra) > 2
        key = (layout, overlap, fp32_weights)
        if key not in trained:
            directory = tmp_path_factory.mktemp(layout)
            args = _args(data_prefix, layout, *(OVERLAP if overlap else []))
            if layout == "dense_dp2" and not overlap:
                args += ["--save", str(directory / "ckpt"), "--save-interval", str(SAVED)]
                args += ["--ckpt-format", "torch"] if fp32_weights else ["--async-save"]
            trained[key] = train(world_size, args, directory, fp32_weights=fp32_weights)
            trained[key]["save"] = directory / "ckpt"
        return trained[key]

    return run


def _data_parallel_size(world_size: int, extra: List[str]) -> int:
    model_parallel = 1
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size"):
        if flag in extra:
            model_parallel *= int(extra[extra.index(flag) + 1])
    return world_size // model_parallel


@pytest.mark.parametrize("overlap", [False, True], ids=["gathered_after_step", "overlapped"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_compute_dtype_weights_give_the_fp32_weights_run(runs, layout, overlap):
    before, after = runs(layout, overlap, True), runs(layout, overlap, False)
    assert before["updated"] == ["torch.float32"]
    assert after["updated"] == ["torch.bfloat16", "torch.float32"]
    iterations = list(range(1, ITERATIONS + 1))
    assert sorted(after["lm loss"]) == iterations
    assert after["lm loss"] == before["lm loss"]
    for step in iterations:
        assert after["grad-norm"][step] == pytest.approx(
            before["grad-norm"][step], rel=GRAD_NORM_TOLERANCE
        ), step


def _resume(data_prefix: str, source: Path, directory: Path, fp32_weights: bool) -> Dict:
    """dense_dp2 resumed from `source`'s checkpoint of iteration SAVED, trained to the end."""
    load = directory / "load"
    load.mkdir(parents=True)
    name = f"iter_{SAVED:07d}"
    shutil.copytree(source / name, load / name)
    (load / "latest_checkpointed_iteration.txt").write_text(str(SAVED))
    args = _args(data_prefix, "dense_dp2", "--load", str(load))
    return train(2, args, directory, fp32_weights=fp32_weights)


def test_checkpoints_hold_fp32_weights_either_way(runs, data_prefix, tmp_path):
    """A checkpoint of the distributed optimizer with fp32 weights (--ckpt-format torch)
    resumes with bf16 weights, and one of bf16 weights (torch_dist, written in the background)
    with fp32 weights, and both go on exactly as the uninterrupted run: a checkpoint holds the
    fp32 master weights, whatever the model computed with, in the formats it always had (the
    two runs' weights are the same bits, and so are the tensors the two formats saved)."""
    fp32_run, bf16_run = runs("dense_dp2", False, True), runs("dense_dp2", False, False)
    later = {step: fp32_run["lm loss"][step] for step in range(SAVED + 1, ITERATIONS + 1)}
    saved, sharded = saved_state(fp32_run["save"], SAVED), saved_state(bf16_run["save"], SAVED)
    assert {str(tensor.dtype) for tensor in sharded["model"].values()} == {"torch.float32"}
    assert list(sharded["model"]) == list(saved["model"])
    for name, tensor in saved["model"].items():
        assert torch.equal(sharded["model"][name], tensor), name
    resumed = _resume(data_prefix, fp32_run["save"], tmp_path / "bf16", fp32_weights=False)
    assert resumed["lm loss"] == later
    resumed = _resume(data_prefix, bf16_run["save"], tmp_path / "fp32", fp32_weights=True)
    assert resumed["lm loss"] == later
