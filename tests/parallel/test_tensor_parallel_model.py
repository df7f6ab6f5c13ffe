"""The tensor-parallel GPTModel against the single-process one, in 2 gloo processes.

Each rank builds the TP=1 model and the TP=2 model from one seed and checks that the sharded
model is the same function: its gathered weights, logits, losses, gradients, grad norm and
one optimizer step equal the single-process ones. Dropout is checked for consistency: masks
that must agree across TP ranks do, and recomputation replays them.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from megatron.checkpointing.full_state import (
    full_model_state_dict,
    full_optimizer_state_dict,
    load_full_optimizer_state_dict,
)
from megatron.config import ModelConfig, OptimizerConfig, TrainingConfig
from megatron.model import GPTModel
from megatron.optimizer import build_optimizer
from megatron.parallel import parallel_state as ps
from megatron.parallelize.steps import apply_activation_recomputation
from megatron.parallelize.tensor_parallelism import apply_tensor_parallel
from megatron.tensor_parallel import (
    MODEL_PARALLEL_RNG,
    all_reduce_sequence_parallel_grads,
    gather_from_tensor_model_parallel_region,
    gather_tensor_model_parallel_weight,
    model_parallel_manual_seed,
    model_parallel_rng_tracker,
)
from tests.launch import run_distributed
from tests.tiny_gpt import sharded_gpt_model, tiny_model_config

TOLERANCE = dict(atol=1e-5, rtol=1e-5)


VARIANTS = {
    "layernorm_learned_tied_gelu": {},
    "gqa_swiglu_untied_rmsnorm_rope": dict(
        num_query_groups=2,
        swiglu=True,
        untie_embeddings_and_output_weights=True,
        normalization="RMSNorm",
        position_embedding_type="rope",
    ),
}


def tokens_and_labels(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(
        0, config.padded_vocab_size, (3, config.seq_length + 1), generator=generator
    )
    return tokens[:, :-1], tokens[:, 1:]


def gathered_grad(param: torch.Tensor) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False):
        return param.grad
    return gather_tensor_model_parallel_weight(
        param.grad, param.partition_dim, param.partition_stride
    )


def optimizer_for(model: GPTModel):
    # SGD: its update is linear in the gradient, so fp32 rounding differences stay small
    # (Adam's first step is lr * sign(grad), which flips for gradients near zero).
    return build_optimizer(
        model,
        OptimizerConfig(lr=1e-2, clip_grad=1.0, optimizer="sgd"),
        TrainingConfig(micro_batch_size=1, global_batch_size=1, num_micro_batches=1),
    )


def _compare_with_single_process(rank: int, world_size: int, overrides: dict, sp: bool) -> None:
    single_config = tiny_model_config(**overrides)
    torch.manual_seed(0)
    single = GPTModel(single_config)
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    model_parallel_manual_seed(0)
    config = replace(single_config, tensor_model_parallel_size=world_size, sequence_parallel=sp)
    parallel = sharded_gpt_model(config)
    # The tensor-parallel step on a model built with weights copies the same shards.
    torch.manual_seed(0)
    copied = apply_tensor_parallel(GPTModel(config), config).state_dict()
    for name, tensor in parallel.state_dict().items():
        assert torch.equal(copied[name], tensor), name

    # Same weights, same checkpoint keys: the gathered TP=2 model is the TP=1 model.
    expected_state = single.state_dict()
    gathered_state = full_model_state_dict(parallel)
    assert gathered_state.keys() == expected_state.keys()
    for name, tensor in expected_state.items():
        assert torch.equal(gathered_state[name], tensor), name

    tokens, labels = tokens_and_labels(config)
    logits = gather_from_tensor_model_parallel_region(parallel(tokens))
    torch.testing.assert_close(logits, single(tokens), **TOLERANCE)

    losses = parallel(tokens, labels=labels)
    expected_losses = single(tokens, labels=labels)
    torch.testing.assert_close(losses, expected_losses, **TOLERANCE)
    losses.mean().backward()
    expected_losses.mean().backward()
    if sp:
        all_reduce_sequence_parallel_grads(parallel.parameters())
    expected_grads = {name: param.grad for name, param in single.named_parameters()}
    for name, param in parallel.named_parameters():
        torch.testing.assert_close(gathered_grad(param), expected_grads[name], **TOLERANCE)

    # The grad norm counts every shard once and every replicated parameter once.
    parallel_optimizer, single_optimizer = optimizer_for(parallel), optimizer_for(single)
    _, norm, _ = parallel_optimizer.step()
    _, expected_norm, _ = single_optimizer.step()
    assert norm == pytest.approx(expected_norm, rel=1e-6)
    stepped = full_model_state_dict(parallel)
    for name, tensor in single.state_dict().items():
        torch.testing.assert_close(stepped[name], tensor, **TOLERANCE)

    # The optimizer state is saved full too (momentum gathered like its parameter) and loads
    # back into this rank's shards.
    full_optimizer = full_optimizer_state_dict(parallel_optimizer)["optimizer"]
    expected_optimizer = single_optimizer.state_dict()["optimizer"]
    assert full_optimizer["param_groups"] == expected_optimizer["param_groups"]
    for index, state in expected_optimizer["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(full_optimizer["state"][index][key], value, **TOLERANCE)
    local = {
        index: {key: value.clone() for key, value in state.items()}
        for index, state in parallel_optimizer.state_dict()["optimizer"]["state"].items()
    }
    load_full_optimizer_state_dict(
        parallel_optimizer, full_optimizer_state_dict(parallel_optimizer)
    )
    for index, state in parallel_optimizer.state_dict()["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, local[index][key]), (index, key)
    ps.destroy_model_parallel()


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tensor_parallel_model_equals_single_process_model(variant, sequence_parallel):
    run_distributed(_compare_with_single_process, 2, VARIANTS[variant], sequence_parallel)


def _loss_and_grads(model: GPTModel, seed: int, sp: bool) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    model_parallel_manual_seed(seed)
    tokens, labels = tokens_and_labels(model.config)
    loss = model(tokens, labels=labels).mean()
    loss.backward()
    if sp:
        all_reduce_sequence_parallel_grads(model.parameters())
    return loss.detach(), {name: param.grad.clone() for name, param in model.named_parameters()}


def _dropout_is_consistent(rank: int, world_size: int, sp: bool) -> None:
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    config = tiny_model_config(
        tensor_model_parallel_size=world_size,
        sequence_parallel=sp,
        hidden_dropout=0.3,
        attention_dropout=0.3,
    )
    models = {}
    full_recompute = dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    for name, recompute in (
        ("plain", {}),
        ("full", full_recompute),
        ("selective", dict(recompute_granularity="selective")),
    ):
        model_parallel_manual_seed(0)
        recompute_config = replace(config, **recompute)
        models[name] = apply_activation_recomputation(
            sharded_gpt_model(recompute_config), recompute_config
        ).train()
    loss, grads = _loss_and_grads(models["plain"], 5, sp)
    # Recomputation replays the dropout masks of the forward, the per-TP-rank ones included.
    for name in ("full", "selective"):
        other_loss, other_grads = _loss_and_grads(models[name], 5, sp)
        assert torch.equal(other_loss, loss), name
        for param_name, grad in grads.items():
            torch.testing.assert_close(other_grads[param_name], grad, atol=1e-6, rtol=1e-6)
    # Every TP rank computes the same loss and the same gradients of replicated parameters,
    # so the replicas of those parameters never drift apart.
    replicated_grads = [
        grads[name]
        for name, param in models["plain"].named_parameters()
        if not getattr(param, "tensor_model_parallel", False)
    ]
    for tensor in [loss, *replicated_grads]:
        peers = [torch.empty_like(tensor) for _ in range(world_size)]
        dist.all_gather(peers, tensor.contiguous())
        assert all(torch.equal(peer, peers[0]) for peer in peers)
    # Dropout is active: another seed gives another loss.
    assert not torch.equal(_loss_and_grads(models["plain"], 6, sp)[0], loss)
    _check_which_stream_each_dropout_draws_from(models["plain"], sp)
    ps.destroy_model_parallel()


def _check_which_stream_each_dropout_draws_from(model: GPTModel, sp: bool) -> None:
    """What differs per TP rank draws from the rank's stream (the attention probabilities of
    its heads, and under sequence parallelism everything: the stream is a shard), what is
    replicated from the default generator, the same on every rank (the residual dropout
    without sequence parallelism)."""
    model_parallel_manual_seed(7)
    tracker = model_parallel_rng_tracker()
    tokens, labels = tokens_and_labels(model.config)
    default_before = torch.get_rng_state()
    rank_stream_before = tracker.get_states()[MODEL_PARALLEL_RNG]
    forks = []
    fork = tracker.fork
    tracker.fork = lambda *args: forks.append(args) or fork(*args)
    try:
        model(tokens, labels=labels)
    finally:
        del tracker.fork
    assert not torch.equal(tracker.get_states()[MODEL_PARALLEL_RNG], rank_stream_before)
    assert torch.equal(torch.get_rng_state(), default_before) == sp
    # Each fork swaps generator states, and a compiled model breaks its graph there: under
    # sequence parallelism the embedding's dropout and the block fork once each, not every
    # dropout; otherwise each layer's attention forks.
    assert len(forks) == (2 if sp else model.config.num_layers)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_dropout_agrees_across_ranks_and_replays_under_recompute(sequence_parallel):
    run_distributed(_dropout_is_consistent, 2, sequence_parallel)
