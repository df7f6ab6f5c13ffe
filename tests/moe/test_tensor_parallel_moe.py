"""MoE / dMoE layers under tensor (and sequence) parallelism, on gloo against one process.

Layer level: each TP rank holds a slice of every expert's ffn channels (moe.experts) and the
layer routes, combines and reduces as moe.tensor_parallel says; its output, input gradient,
auxiliary losses and gradients (the router's identical on every TP rank, the experts' gathered
over TP) must be the single-process ones. End to end: a tiny dMoE GPT at TP=2, TP=2 with
sequence parallelism and TP=2 x DP=2 gives the single-process losses and grad norms, and its
checkpoints move between TP=2 and one process.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import pretrain_gpt
from megatron.parallel import parallel_state as ps
from megatron.parallel.expert_parameters import is_expert_parameter, reduce_expert_gradients
from megatron.parallelize.steps import place_experts
from megatron.parallelize.tensor_parallelism import apply_tensor_parallel
from megatron.tensor_parallel import (
    all_reduce_sequence_parallel_grads,
    gather_tensor_model_parallel_weight,
)
from moe.config import MoEConfig
from moe.kernels import grouped_gemm
from moe.layers import build_moe_layer
from moe.mlp_spec import MoEMlpSpec
from tests.launch import run_distributed
from tests.tiny_gpt import MOE_ARGS, moe_layer_model_config, saved_state, tiny_gpt_args

HIDDEN, FFN, SEQUENCE, EXPERTS = 16, 32, 8, 4
CLOSE = dict(atol=1e-5, rtol=1e-5)


# name -> (ModelConfig overrides, MoEConfig overrides)
LAYERS = {
    "dmoe_grouped_bias_shared": (
        dict(add_bias_linear=True),
        dict(mlp_impl="grouped", shared_expert=True),
    ),
    "dmoe_reference": ({}, dict(mlp_impl="reference")),
    "dmoe_sparse": ({}, dict(mlp_impl="sparse")),
    # Capacity int(1.0 * 2 * 16 / 4) = 8 assignments per expert: some are dropped.
    "moe_capacity_grouped": ({}, dict(dropless=False, capacity_factor=1.0)),
    "moe_capacity_reference_glu": (
        dict(swiglu=True),
        dict(dropless=False, mlp_impl="reference", mlp_type="glu"),
    ),
}
# The grouped GEMM a run on Hopper chooses, torch._grouped_mm (torch 2.8 and newer), here by
# torch's CPU kernel in fp32.
if grouped_gemm.torch_has_grouped_mm():
    LAYERS["dmoe_torch_grouped_mm_glu"] = (
        dict(swiglu=True),
        dict(mlp_impl="grouped", mlp_type="glu", grouped_gemm=grouped_gemm.TORCH),
    )


def make_layer(name: str, tensor_parallel: int = 1, sequence_parallel: bool = False, ep: int = 1):
    model_overrides, moe_overrides = LAYERS[name]
    config = moe_layer_model_config(
        HIDDEN,
        FFN,
        SEQUENCE,
        tensor_model_parallel_size=tensor_parallel,
        sequence_parallel=sequence_parallel,
        **model_overrides,
    )
    moe = MoEConfig(
        num_experts=EXPERTS,
        top_k=2,
        zloss_weight=0.1,
        **moe_overrides,
    )
    torch.manual_seed(0)
    # Built whole, then cut to this rank's shards by megatron.parallelize.steps's steps, which copy
    # them: every layout holds slices of the single-process weights.
    layer = apply_tensor_parallel(build_moe_layer(config, moe), config, MoEMlpSpec(moe))
    return place_experts(layer)


def batches(data_parallel_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, output directions), [dp, 2, SEQUENCE, HIDDEN]: replica d's micro-batch is [d]."""
    generator = torch.Generator().manual_seed(1)
    shape = (data_parallel_size, 2, SEQUENCE, HIDDEN)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def layer_loss(layer, tokens: torch.Tensor, direction: torch.Tensor):
    """<output, direction> plus the weighted auxiliary losses, as the training step adds them;
    (loss, output)."""
    output = layer(tokens)
    auxiliary = (
        0.1 * layer.auxiliary_losses["load balancing loss"]
        + 0.1 * layer.auxiliary_losses["router z loss"]
    )
    return (output * direction).sum() + auxiliary, output


def _tensor_parallel_layers(rank: int, world_size: int, cases: list, ep: int) -> dict:
    """Every (layer name, sequence parallel) case on this rank, in one set of processes."""
    return {case: _tensor_parallel_layer(*case, ep) for case in cases}


def _tensor_parallel_layer(name: str, sp: bool, ep: int) -> dict:
    tensor_parallel = 2
    ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=ep)
    try:
        layer = make_layer(name, tensor_parallel, sp, ep)
        data_rank, data_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        tokens, direction = (batch[data_rank] for batch in batches(data_size))
        if sp:
            # This rank's sequence shard; the loss of the other shard is its peer's share.
            tensor_rank = ps.get_tensor_model_parallel_rank()
            tokens, direction = (
                batch.chunk(tensor_parallel, dim=1)[tensor_rank].contiguous()
                for batch in (tokens, direction)
            )
        tokens.requires_grad_(True)
        loss, output = layer_loss(layer, tokens, direction)
        loss.backward()
        # What GradientSync.after_backwards and DDP do after the last backward.
        if sp:
            all_reduce_sequence_parallel_grads(layer.parameters())
        for param in layer.parameters():
            if data_size > 1 and not is_expert_parameter(param):
                dist.all_reduce(param.grad, group=ps.get_data_parallel_group())
                param.grad /= data_size
        reduce_expert_gradients(layer)
        return {
            "output": output.detach(),
            "input_grad": tokens.grad,
            "local_grads": {n: p.grad.clone() for n, p in layer.named_parameters()},
            "grads": {  # gathered over TP: this rank's experts, all ffn channels
                n: gather_tensor_model_parallel_weight(p.grad, getattr(p, "partition_dim", None))
                for n, p in layer.named_parameters()
            },
            "sharded": sorted(
                n for n, p in layer.named_parameters() if getattr(p, "tensor_model_parallel", 0)
            ),
            "sequence_parallel": sorted(
                n for n, p in layer.named_parameters() if getattr(p, "sequence_parallel", False)
            ),
            "load_balancing_loss": layer.auxiliary_losses["load balancing loss"].detach(),
            "router_z_loss": layer.auxiliary_losses["router z loss"].detach(),
            "tokens_per_expert": layer.tokens_per_expert.clone(),
        }
    finally:
        ps.destroy_model_parallel()


def check_layer_against_one_process(results: list, name: str, sp: bool, ep: int = 1):
    """`results`: each rank's outcome of this case (`_tensor_parallel_layer`)."""
    world_size = len(results)
    data_size = world_size // 2
    reference = make_layer(name)
    tokens, directions = batches(data_size)
    expected = []
    for replica in range(data_size):
        replica_tokens = tokens[replica].clone().requires_grad_(True)
        loss, output = layer_loss(reference, replica_tokens, directions[replica])
        # Data parallelism averages the replicas' gradients.
        (loss / data_size).backward()
        expected.append(
            {
                "output": output.detach(),
                "input_grad": replica_tokens.grad * data_size,
                "load_balancing_loss": reference.auxiliary_losses["load balancing loss"].detach(),
                "router_z_loss": reference.auxiliary_losses["router z loss"].detach(),
                "tokens_per_expert": reference.tokens_per_expert.clone(),
            }
        )
    reference_grads = {n: p.grad for n, p in reference.named_parameters()}
    expert_names = {"experts.w1", "experts.w2", "experts.v1"} & set(reference_grads)
    local_experts = EXPERTS // ep
    for rank, result in enumerate(results):
        tensor_rank, data_rank = rank % 2, rank // 2
        want = expected[data_rank]
        output, input_grad = want["output"], want["input_grad"]
        if sp:
            output, input_grad = (t.chunk(2, dim=1)[tensor_rank] for t in (output, input_grad))
        torch.testing.assert_close(result["output"], output, **CLOSE)
        torch.testing.assert_close(result["input_grad"], input_grad, **CLOSE)
        for key in ("load_balancing_loss", "router_z_loss"):
            torch.testing.assert_close(result[key], want[key], **CLOSE)
        assert result["tokens_per_expert"].tolist() == want["tokens_per_expert"].tolist()
        assert set(result["sharded"]) == expert_names | {
            n for n in reference_grads if "shared_expert.linear_fc" in n and "fc2.bias" not in n
        }
        replicated_sp = {"router.layer.weight", "bias"} & set(reference_grads)
        assert set(result["sequence_parallel"]) == (replicated_sp if sp else set())
        first = (rank // 2 % ep) * local_experts
        for param_name, grad in result["grads"].items():
            expected_grad = reference_grads[param_name]
            if param_name in expert_names:
                expected_grad = expected_grad[first : first + local_experts]
            torch.testing.assert_close(grad, expected_grad, msg=param_name, **CLOSE)
    # The replicated router weight's gradient is the same tensor on every TP rank (not just
    # close), so the replicas never drift apart.
    for rank in range(0, world_size, 2):
        pair = [results[rank + i]["local_grads"]["router.layer.weight"] for i in range(2)]
        assert torch.equal(pair[0], pair[1])


LAYER_CASES = [(name, sp) for name in sorted(LAYERS) for sp in (False, True)]
EXPERT_PARALLEL_CASES = [("dmoe_grouped_bias_shared", sp) for sp in (False, True)]


@pytest.fixture(scope="module")
def two_ranks():
    """Every layer case at TP=2, computed in one pair of processes (a fork per case would cost
    more than the cases)."""
    results = run_distributed(_tensor_parallel_layers, 2, LAYER_CASES, 1)
    return {case: [rank_results[case] for rank_results in results] for case in LAYER_CASES}


@pytest.fixture(scope="module")
def four_ranks_expert_parallel():
    results = run_distributed(_tensor_parallel_layers, 4, EXPERT_PARALLEL_CASES, 2)
    return {case: [rank[case] for rank in results] for case in EXPERT_PARALLEL_CASES}


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_matches_one_process(two_ranks, name, sp):
    check_layer_against_one_process(two_ranks[name, sp], name, sp)
    if name.startswith("moe_capacity"):
        assert max(two_ranks[name, sp][0]["tokens_per_expert"]) > 8  # drops were exercised


@pytest.mark.parametrize("sp", [False, True], ids=["tp2_ep2", "tp2_ep2_sp"])
def test_layer_with_expert_parallelism_matches_one_process(four_ranks_expert_parallel, sp):
    """World 4, TP=2 x EP=2: TP groups [0, 1] and [2, 3], expert-parallel groups [0, 2] and
    [1, 3] (one per TP rank, each moving rows between the holders of its ffn channels)."""
    name = "dmoe_grouped_bias_shared"
    check_layer_against_one_process(four_ranks_expert_parallel[name, sp], name, sp, ep=2)


# End to end ------------------------------------------------------------------------------------
ITERATIONS = 5
SCALARS = ("lm loss", "load balancing loss", "grad-norm")
EXPERT_LOAD = "moe/tokens-per-expert layer {}"


def moe_gpt_args(data_prefix, *extra, tensor_parallel=1):
    """A tiny fp32 dMoE GPT. A global batch of 8 in micro-batches of 2 keeps each micro-batch's
    samples (and so its load-balancing loss) the same at any data-parallel size."""
    return tiny_gpt_args(
        data_prefix, *MOE_ARGS, "--moe-loss-weight", "0.1", *extra,
        num_layers=4, hidden_size=32, seq_length=32, micro_batch=2, global_batch=8,
        train_iters=ITERATIONS, eval_iters=0, tensor_parallel=tensor_parallel,
    )  # fmt: skip


def _pretrain(rank: int, world_size: int, args: list) -> str:
    # torchrun's environment; the process group run_distributed made is the one main joins.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        pretrain_gpt.main(args)
    return stdout.getvalue()


def train(nproc: int, args: list, tensorboard_dir: Path) -> dict:
    """pretrain_gpt.main on `nproc` forked gloo ranks (no interpreter start-up per rank, most of
    a torchrun launch's time here): rank 0's stdout and its TensorBoard scalars at full
    precision ({name: {iteration: value}})."""
    args = [*args, "--tensorboard-dir", str(tensorboard_dir)]
    stdout = run_distributed(_pretrain, nproc, args, timeout_s=120)[0]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tensorboard_dir), size_guidance={"histograms": 0})
    events.Reload()
    scalars = {name: {e.step: e.value for e in events.Scalars(name)} for name in SCALARS}
    # Tokens routed per MoE layer and iteration (moe.expert_load), as TensorBoard's histogram
    # of tokens per expert sums them.
    routed = {
        layer: {e.step: e.histogram_value.sum for e in events.Histograms(EXPERT_LOAD.format(layer))}
        for layer in range(4)
    }
    return {"stdout": stdout, "routed": routed, **scalars}


def assert_same_run(expected: dict, actual: dict, iterations=range(1, ITERATIONS + 1)):
    # Tensor-parallel ranks route the same tokens and count them once: 8 samples x 32 tokens x
    # top-2 per layer and iteration, as in one process.
    for layer in range(4):
        assert actual["routed"][layer] == {step: 8 * 32 * 2 for step in iterations}
    for name in SCALARS:
        assert sorted(actual[name]) == list(iterations), (name, actual[name])
        for step in iterations:
            assert actual[name][step] == pytest.approx(expected[name][step], rel=1e-5), (
                name,
                step,
                expected[name],
                actual[name],
            )


@pytest.fixture(scope="module")
def single_and_tensor_parallel(data_prefix, tmp_path_factory):
    """One process and TP=2, each saving at iterations 3 and 5."""
    root = tmp_path_factory.mktemp("moe_runs")
    runs = {}
    for name, nproc in (("single", 1), ("tp2", 2)):
        save = ["--save", str(root / f"{name}_ckpt"), "--save-interval", "3"]
        args = moe_gpt_args(data_prefix, *save, tensor_parallel=nproc)
        runs[name] = train(nproc, args, root / f"{name}_tb")
        runs[name]["checkpoints"] = root / f"{name}_ckpt"
    return runs


def test_tensor_parallel_dmoe_gpt_matches_one_process(single_and_tensor_parallel):
    single, parallel = single_and_tensor_parallel["single"], single_and_tensor_parallel["tp2"]
    assert "tensor-model-parallel size: 2" in parallel["stdout"]
    assert_same_run(single, parallel)
    # The checkpoint holds whole experts (all ffn channels) and their Adam moments, under the
    # keys and shapes of a single-process run.
    expected, saved = (saved_state(run["checkpoints"], 5) for run in (single, parallel))
    assert saved["model"]["decoder.layers.0.mlp.experts.w1"].shape == (4, 32, 128)
    assert saved["model"].keys() == expected["model"].keys()
    for name, tensor in expected["model"].items():
        torch.testing.assert_close(saved["model"][name], tensor, atol=1e-5, rtol=1e-4)
    for index, state in expected["optimizer"]["optimizer"]["state"].items():
        for key, value in state.items():
            saved_value = saved["optimizer"]["optimizer"]["state"][index][key]
            torch.testing.assert_close(saved_value, value, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "nproc, extra",
    [
        # The reference backend's per-expert loop, under sequence parallelism.
        (2, ["--sequence-parallel", "--moe-impl", "reference"]),
        (4, []),
        (4, ["--sequence-parallel", "--deterministic-mode"]),
    ],
    ids=["tp2_sp_reference", "tp2_dp2", "tp2_sp_dp2_deterministic"],
)
def test_sequence_and_data_parallel_dmoe_gpt_match_one_process(
    single_and_tensor_parallel, data_prefix, tmp_path, nproc, extra
):
    args = moe_gpt_args(data_prefix, *extra, tensor_parallel=2)
    run = train(nproc, args, tmp_path / "tb")
    assert f"data-parallel size: {nproc // 2}" in run["stdout"]
    assert_same_run(single_and_tensor_parallel["single"], run)


@pytest.mark.parametrize("saved, resumed", [("tp2", 1), ("single", 2)])
def test_dmoe_checkpoint_resumes_at_another_tensor_parallel_size(
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
    args = moe_gpt_args(data_prefix, "--load", str(load), tensor_parallel=resumed)
    run = train(resumed, args, tmp_path / "tb")
    assert "saved at another tensor-parallel size" in run["stdout"]
    assert_same_run(single_and_tensor_parallel["single"], run, iterations=range(4, 6))
