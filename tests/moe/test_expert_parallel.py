"""Expert-parallel dMoE (moe.exchange) on gloo against one process holding every expert.

Each rank feeds its own tokens. Data parallelism's answer is the single-process layer on all
tokens with the loss averaged over ranks; the expert-parallel layer must give the same outputs,
input gradients, and (after the non-expert gradients are averaged over data parallelism and
`reduce_expert_gradients` ran) the same slice of every expert gradient.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.distributed as dist

from megatron.config import (
    ModelConfig,
    OptimizerConfig,
    TrainingConfig,
)
from megatron.model import GPTModel
from megatron.optimizer import build_optimizer
from megatron.parallel import parallel_state
from megatron.parallel.expert_parameters import (
    expert_parameters,
    is_expert_parameter,
    mark_expert_parallel,
    reduce_expert_gradients,
)
from megatron.parallelize.gradient_sync import data_parallel_ignored_names, wrap_data_parallel
from megatron.parallelize.steps import place_experts
from moe.config import MoEConfig
from moe.kernels.grouped_gemm import MOE as MOE_GEMM
from moe.kernels.grouped_gemm import TORCH
from moe.layers import build_moe_layer
from moe.mlp_spec import MoEMlpSpec
from tests.launch import run_distributed
from tests.markers import needs_torch_grouped_mm
from tests.tiny_gpt import moe_layer_model_config, sharded_gpt_model

HIDDEN, FFN, TOKENS, EXPERTS = 8, 32, 6, 4


pytestmark = pytest.mark.usefixtures("reference_kernels")


def model_config(**overrides) -> ModelConfig:
    return moe_layer_model_config(HIDDEN, FFN, TOKENS, **overrides)


def make_layer(
    impl: str, top_k: int, expert_parallel_size: int, targets: Optional[list], **overrides
):
    """The layer every run builds from seed 0 (MoEConfig `overrides`); with `targets`, a router
    that sends a token whose feature e is large to expert e (see `make_tokens`)."""
    torch.manual_seed(0)
    config = MoEConfig(
        num_experts=EXPERTS, top_k=top_k, mlp_impl=impl, **{"zloss_weight": 1e-3, **overrides}
    )
    layer = place_experts(build_moe_layer(model_config(), config))
    if targets is not None:
        with torch.no_grad():
            layer.router.layer.weight.copy_(torch.eye(EXPERTS, HIDDEN))
    return layer


def make_tokens(world_size: int, targets: Optional[list]) -> torch.Tensor:
    """[world_size, TOKENS, HIDDEN]: rank r's tokens are row r; targets[r][t] steers token t."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randn(world_size, TOKENS, HIDDEN, generator=generator)
    if targets is not None:
        tokens *= 0.1
        steer = torch.nn.functional.one_hot(torch.tensor(targets), HIDDEN).float()
        tokens += 4.0 * steer
    return tokens


def probe(world_size: int) -> torch.Tensor:
    """A fixed direction per output element, so that every output value matters to the loss."""
    generator = torch.Generator().manual_seed(2)
    return torch.randn(world_size, TOKENS, HIDDEN, generator=generator)


def local_loss(layer, tokens: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """Mean over the tokens of <output, direction>, plus the router z-loss (also a mean over
    tokens), so that the mean of per-rank losses is the loss of all tokens."""
    output = layer(tokens)
    return (output * direction).sum() / direction[..., 0].numel() + layer.auxiliary_losses[
        "router z loss"
    ], output


def _expert_parallel_step(
    rank: int,
    world_size: int,
    impl: str,
    top_k: int,
    ep: int,
    targets: Optional[list],
    overrides: Optional[dict] = None,
) -> dict:
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    try:
        layer = make_layer(impl, top_k, ep, targets, **(overrides or {}))
        tokens = make_tokens(world_size, targets)[rank : rank + 1].clone().requires_grad_(True)
        loss, output = local_loss(layer, tokens, probe(world_size)[rank : rank + 1])
        loss.backward()
        # What DDP does for the replicated parameters: average over data parallelism.
        for param in layer.parameters():
            if not is_expert_parameter(param):
                dist.all_reduce(param.grad)
                param.grad /= world_size
        reduce_expert_gradients(layer)
        return {
            "output": output.detach()[0],
            "input_grad": tokens.grad[0],
            "grads": {name: param.grad for name, param in layer.named_parameters()},
            "expert_names": [n for n, p in layer.named_parameters() if is_expert_parameter(p)],
            "tokens_per_expert": layer.tokens_per_expert.clone(),
            "load_balancing_loss": layer.auxiliary_losses["load balancing loss"].detach(),
        }
    finally:
        parallel_state.destroy_model_parallel()


def assert_rank_gradients(result: dict, reference, rank: int, ep: int) -> None:
    """Every parameter gradient of an expert-parallel rank equals the one-process reference's,
    its block of the experts for the expert weights."""
    local_experts = EXPERTS // ep
    first = (rank % ep) * local_experts
    reference_grads = dict(reference.named_parameters())
    for name, grad in result["grads"].items():
        expected = reference_grads[name].grad
        if name in result["expert_names"]:
            expected = expected[first : first + local_experts]
        torch.testing.assert_close(grad, expected, msg=f"rank {rank} {name}", atol=1e-5, rtol=1e-5)


def check_against_one_process(
    impl: str, top_k: int, world_size: int, ep: int, targets=None, overrides=None
):
    results = run_distributed(
        _expert_parallel_step, world_size, impl, top_k, ep, targets, overrides
    )
    reference = make_layer(impl, top_k, 1, targets, **(overrides or {}))
    all_tokens = make_tokens(world_size, targets).view(1, world_size * TOKENS, HIDDEN)
    all_tokens.requires_grad_(True)
    loss, output = local_loss(reference, all_tokens, probe(world_size).view_as(all_tokens))
    loss.backward()
    per_rank_output = output.detach().view(world_size, TOKENS, HIDDEN)
    # d(mean over ranks)/d(rank r's tokens) is 1/world_size of rank r's own loss gradient.
    per_rank_input_grad = all_tokens.grad.view(world_size, TOKENS, HIDDEN) * world_size
    total_tokens_per_expert = torch.zeros(EXPERTS, dtype=torch.long)
    for rank, result in enumerate(results):
        close = dict(atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(result["output"], per_rank_output[rank], **close)
        torch.testing.assert_close(result["input_grad"], per_rank_input_grad[rank], **close)
        assert sorted(result["expert_names"]) == ["experts.w1", "experts.w2"]
        assert_rank_gradients(result, reference, rank, ep)
        # Routing statistics are each rank's own: its tokens, all experts.
        rank_tokens = make_tokens(world_size, targets)[rank : rank + 1]
        with torch.no_grad():
            reference(rank_tokens)
        torch.testing.assert_close(
            result["load_balancing_loss"], reference.auxiliary_losses["load balancing loss"]
        )
        total_tokens_per_expert += result["tokens_per_expert"]
    with torch.no_grad():
        reference(all_tokens)
    assert total_tokens_per_expert.tolist() == reference.tokens_per_expert.tolist()
    return results


@pytest.mark.parametrize("impl", ["grouped", "sparse"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_two_ranks_match_one_process(impl, top_k):
    check_against_one_process(impl, top_k, world_size=2, ep=2)


@pytest.mark.parametrize(
    "impl, grouped_gemm",
    [
        ("grouped", MOE_GEMM),
        pytest.param("grouped", TORCH, marks=needs_torch_grouped_mm),
        ("sparse", MOE_GEMM),
    ],
    ids=["grouped", "grouped_torch_grouped_mm", "sparse"],
)
def test_fixed_size_blocks_match_one_process(impl, grouped_gemm):
    """--moe-expert-parallel-buffer-factor (blocks large enough): the layer's outputs and
    every gradient are one process's, on each backend (the grouped products leave the padding
    rows out of every pass, the block-sparse one computes them as zeros), in one exchange and
    in chunks (--moe-expert-parallel-chunked-overlap)."""
    overrides = {"expert_parallel_buffer_factor": 4.0, "grouped_gemm": grouped_gemm}
    check_against_one_process(impl, 2, world_size=2, ep=2, overrides=overrides)
    targets = [[2, 3, 2, 2, 3, 3], [3, 3, 2, 3, 2, 2]]
    overrides["expert_parallel_chunks"] = 2
    check_against_one_process(impl, 1, world_size=2, ep=2, targets=targets, overrides=overrides)


@pytest.mark.parametrize("impl", ["grouped", "sparse"])
def test_four_ranks_two_expert_data_parallel_replicas(impl):
    # Expert groups [0, 1] and [2, 3]; ranks 0 and 2 (1 and 3) hold the same experts.
    check_against_one_process(impl, top_k=2, world_size=4, ep=2)


@pytest.mark.parametrize("impl", ["grouped", "sparse"])
def test_all_tokens_to_one_ranks_experts(impl):
    # Rank 0's experts 0 and 1 get nothing: rank 0 receives no rows and its gradients are zero.
    targets = [[2, 3, 2, 2, 3, 3], [3, 3, 2, 3, 2, 2]]
    results = check_against_one_process(impl, 1, world_size=2, ep=2, targets=targets)
    assert all(result["tokens_per_expert"][:2].sum() == 0 for result in results)
    assert results[0]["grads"]["experts.w1"].abs().sum() == 0


@pytest.mark.parametrize("impl", ["grouped", "sparse"])
def test_crossed_routing_with_an_idle_expert(impl):
    # Rank 0 sends everything to rank 1's experts; rank 1 uses experts 0 and 2; expert 1 idles.
    targets = [[2, 3, 3, 2, 2, 3], [0, 2, 0, 0, 2, 0]]
    results = check_against_one_process(impl, 1, world_size=2, ep=2, targets=targets)
    assert results[0]["tokens_per_expert"].tolist() == [0, 0, 3, 3]
    assert results[1]["tokens_per_expert"].tolist() == [4, 0, 2, 0]


def test_grouped_backend_on_the_triton_kernels(triton_kernels):
    """The same exchange through the Triton permute and grouped-GEMM kernels (the interpreter
    on the CPU; the ranks hold CPU tensors): top_k = 1 gathers without weights, and a rank
    that receives no rows."""
    check_against_one_process("grouped", 2, world_size=2, ep=2)
    targets = [[2, 3, 2, 2, 3, 3], [3, 3, 2, 3, 2, 2]]
    check_against_one_process("grouped", 1, world_size=2, ep=2, targets=targets)


def _gpt_expert_weights(rank: int, world_size: int) -> list:
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world_size)
    try:
        moe = MoEConfig(num_experts=EXPERTS)
        torch.manual_seed(0)
        model = sharded_gpt_model(model_config(padded_vocab_size=32), MoEMlpSpec(moe))
        return [param.detach() for param in expert_parameters(model)]
    finally:
        parallel_state.destroy_model_parallel()


def check_capacity_moe_against_each_rank(
    capacity_factor: float, top_k: int, world_size: int, ep: int, targets=None
):
    """The capacity-limited MoE under expert parallelism: each rank's output is what one
    process gives for that rank's tokens alone (the same drops), and the gradients are the
    data-parallel mean of those processes' gradients."""
    overrides = {"dropless": False, "capacity_factor": capacity_factor}
    results = run_distributed(
        _expert_parallel_step, world_size, "grouped", top_k, ep, targets, overrides
    )
    reference = make_layer("grouped", top_k, 1, targets, **overrides)
    tokens, directions = make_tokens(world_size, targets), probe(world_size)
    outputs, input_grads, balance = [], [], []
    for rank in range(world_size):
        rank_tokens = tokens[rank : rank + 1].clone().requires_grad_(True)
        loss, output = local_loss(reference, rank_tokens, directions[rank : rank + 1])
        (loss / world_size).backward()
        outputs.append(output.detach()[0])
        input_grads.append(rank_tokens.grad[0] * world_size)
        balance.append(reference.auxiliary_losses["load balancing loss"].detach())
    for rank, result in enumerate(results):
        close = dict(atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(result["output"], outputs[rank], **close)
        torch.testing.assert_close(result["input_grad"], input_grads[rank], **close)
        torch.testing.assert_close(result["load_balancing_loss"], balance[rank])
        assert_rank_gradients(result, reference, rank, ep)
    return results


@pytest.mark.parametrize("top_k", [1, 2])
def test_capacity_moe_two_ranks(top_k):
    check_capacity_moe_against_each_rank(1.0, top_k, world_size=2, ep=2)


def test_capacity_moe_drops_as_each_rank_alone():
    """Every token steered to experts 2 and 3 with capacity int(1 x 1 x 6 / 4) = 1: most
    assignments are dropped, the same ones as in one process per rank."""
    targets = [[2, 3, 2, 2, 3, 3], [3, 3, 2, 3, 2, 2]]
    results = check_capacity_moe_against_each_rank(1.0, 1, world_size=2, ep=2, targets=targets)
    dropped = [(result["output"].abs().sum(-1) == 0).sum().item() for result in results]
    assert dropped == [4, 4], dropped  # 6 tokens, 2 slots each rank (one per busy expert)


def test_capacity_moe_without_a_limit_and_expert_data_parallel_replicas():
    """--moe-capacity-factor 0: slots for the busiest expert of the group; world 4 at EP2."""
    check_capacity_moe_against_each_rank(0.0, 2, world_size=4, ep=2)


def test_gpt_model_expert_shards_are_slices_of_the_single_process_weights():
    shards = run_distributed(_gpt_expert_weights, 2)
    torch.manual_seed(0)
    model = GPTModel(model_config(padded_vocab_size=32), MoEMlpSpec(MoEConfig(num_experts=EXPERTS)))
    full = [param for name, param in model.named_parameters() if ".experts." in name]
    assert len(full) == len(shards[0]) == 4  # w1 and w2 of two MoE layers
    for rank, rank_shards in enumerate(shards):
        for shard, weight in zip(rank_shards, full):
            torch.testing.assert_close(shard, weight.detach()[rank * 2 : rank * 2 + 2])


def _full_gradients() -> dict:
    """Gradients of a two-parameter model in one process, with zeros among them."""
    generator = torch.Generator().manual_seed(3)
    grads = {
        "replicated": torch.randn(5, 3, generator=generator),
        "experts": torch.randn(EXPERTS, 3, 2, generator=generator),
    }
    grads["replicated"][0] = 0.0
    grads["experts"][1:3, 0] = 0.0
    return grads


class _TwoParameters(torch.nn.Module):
    def __init__(self, num_local_experts: int) -> None:
        super().__init__()
        self.replicated = torch.nn.Parameter(torch.zeros(5, 3))
        self.experts = torch.nn.Parameter(torch.zeros(num_local_experts, 3, 2))

    def forward(self) -> torch.Tensor:
        return self.replicated.sum() + self.experts.sum()


def _optimizer_norm_and_zeros(rank: int, world_size: int, ep: int) -> tuple:
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    try:
        local = EXPERTS // ep
        model = _TwoParameters(local)
        mark_expert_parallel(model.experts)
        optimizer = build_optimizer(
            model,
            OptimizerConfig(lr=0.0, clip_grad=0.0),
            TrainingConfig(micro_batch_size=1, global_batch_size=world_size, num_micro_batches=1),
            log_num_zeros_in_grad=True,
        )
        grads = _full_gradients()
        first = parallel_state.get_expert_model_parallel_rank() * local
        model.replicated.grad = grads["replicated"].clone()
        model.experts.grad = grads["experts"][first : first + local].clone()
        _, grad_norm, num_zeros = optimizer.step()
        return grad_norm, num_zeros
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("world_size, ep", [(2, 2), (4, 2)])
def test_optimizer_counts_each_expert_shard_once(world_size, ep):
    """Grad norm and zero count: replicated gradients once, expert shards summed over the
    expert-parallel group; every rank gets the single-process numbers."""
    grads = _full_gradients()
    expected_norm = torch.cat([grad.reshape(-1) for grad in grads.values()]).norm().item()
    expected_zeros = sum(int((grad == 0).sum()) for grad in grads.values())
    for grad_norm, num_zeros in run_distributed(_optimizer_norm_and_zeros, world_size, ep):
        assert grad_norm == pytest.approx(expected_norm, rel=1e-6)
        assert num_zeros == expected_zeros


def _data_parallel_wrapper_leaves_experts_alone(rank: int, world_size: int) -> dict:
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world_size)
    try:
        model = _TwoParameters(EXPERTS // world_size)
        mark_expert_parallel(model.experts)
        with torch.no_grad():
            model.replicated.fill_(float(rank))
            model.experts.fill_(float(rank))
        wrapped = wrap_data_parallel(model, torch.device("cpu"), None)
        # A loss whose gradient is rank + 1 on every element of both parameters.
        (wrapped() * (rank + 1)).backward()
        return {
            "ignored": data_parallel_ignored_names(model),
            "replicated": model.replicated.detach().clone(),
            "experts": model.experts.detach().clone(),
            "replicated_grad": model.replicated.grad.clone(),
            "experts_grad": model.experts.grad.clone(),
        }
    finally:
        parallel_state.destroy_model_parallel()


def test_data_parallel_wrapper_leaves_experts_alone():
    """DDP broadcasts and averages the replicated parameter only: each rank keeps its experts
    and their local gradient (reduce_expert_gradients' job)."""
    results = run_distributed(_data_parallel_wrapper_leaves_experts_alone, 2)
    for rank, result in enumerate(results):
        assert result["ignored"] == ["experts"]
        assert torch.all(result["replicated"] == 0.0)  # rank 0's value, broadcast
        assert torch.all(result["experts"] == float(rank))
        assert torch.all(result["replicated_grad"] == 1.5)  # mean of 1 and 2
        assert torch.all(result["experts_grad"] == float(rank + 1))
