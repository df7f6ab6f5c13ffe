"""Pipeline-parallel GPT stages with the 1F1B and interleaved schedules, in gloo processes.

Every rank also trains the single-process model from the same weights on the same
micro-batches; the pipeline's losses, grad norms and final weights (under single-process
names) must match it over several optimizer steps, for plain and interleaved schedules, with
tied and untied embeddings, and with tensor parallelism inside each stage.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatron.checkpointing.full_state import full_model_state_dict
from megatron.config import ModelConfig, OptimizerConfig, TrainingConfig
from megatron.model import GPTModel
from megatron.optimizer import build_optimizer
from megatron.parallel import parallel_state as ps
from megatron.parallelize.gradient_sync import reduce_tied_embedding_gradients
from megatron.parallelize.steps import split_pipeline
from megatron.pipeline import p2p
from megatron.pipeline.p2p import ActivationSpec
from megatron.pipeline.schedules import (
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
)
from megatron.pipeline.stages import stage_layer_numbers, stage_to_full_names
from megatron.tensor_parallel import model_parallel_manual_seed
from tests.launch import run_distributed
from tests.tiny_gpt import sharded_gpt_model, tiny_model_config

STEPS = 5
MICRO_BATCH = 2
TOLERANCE = dict(atol=1e-5, rtol=1e-5)
LAYERS = 4  # splits evenly over every pipeline layout of CASES


def optimizer_for(model: nn.Module):
    # SGD with momentum: linear in the gradient, so fp32 rounding stays at the 1e-6 level
    # over several steps (Adam's early steps amplify it for gradients near zero).
    return build_optimizer(
        model,
        OptimizerConfig(lr=5e-2, clip_grad=1.0, optimizer="sgd", sgd_momentum=0.9),
        TrainingConfig(micro_batch_size=MICRO_BATCH, global_batch_size=8, num_micro_batches=4),
    )


def micro_batches(config: ModelConfig, step: int, count: int) -> list:
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(
        0,
        config.padded_vocab_size,
        (count, MICRO_BATCH, config.seq_length + 1),
        generator=generator,
    )
    return [{"tokens": batch[:, :-1], "labels": batch[:, 1:]} for batch in tokens]


def forward_step(model: GPTModel, batch: dict):
    output = model(batch["tokens"], labels=batch["labels"])
    if not model.post_process:
        return output, {}
    loss = output.mean()
    return loss, {"lm loss": loss.detach()}


def single_process_run(config: ModelConfig, num_micro_batches: int):
    torch.manual_seed(1234)
    model = GPTModel(config)
    initial = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    optimizer = optimizer_for(model)
    losses, norms = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        step_losses = []
        for batch in micro_batches(config, step, num_micro_batches):
            loss, _ = forward_step(model, batch)
            (loss / num_micro_batches).backward()
            step_losses.append(loss.item())
        _, norm, _ = optimizer.step()
        losses.append(sum(step_losses) / num_micro_batches)
        norms.append(norm)
    return initial, losses, norms, model.state_dict()


def _pipeline_matches_single_process(
    rank: int,
    world_size: int,
    pipeline: int,
    virtual: int | None,
    tensor: int,
    num_micro_batches: int,
    overrides: dict,
) -> dict:
    config = tiny_model_config(num_layers=LAYERS, **overrides)
    initial, expected_losses, expected_norms, expected_final = single_process_run(
        config, num_micro_batches
    )
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tensor,
        pipeline_model_parallel_size=pipeline,
        virtual_pipeline_model_parallel_size=virtual,
    )
    model_parallel_manual_seed(1234)
    config = replace(config, tensor_model_parallel_size=tensor)
    chunks = list(split_pipeline(sharded_gpt_model(config)))

    # The stages start from the single-process weights, drawn once for the whole model.
    for chunk in chunks:
        for name, tensor in stage_to_full_names(full_model_state_dict(chunk), chunk).items():
            assert torch.equal(tensor, initial[name]), name
    # Megatron's tied embeddings: the last stage's copy starts equal to the first's table.
    if ps.is_rank_in_embedding_group() and not config.untie_embeddings_and_output_weights:
        holder = chunks[0] if ps.is_pipeline_first_stage(ignore_virtual=True) else chunks[-1]
        table = holder.output_weight()
        reference = table.detach().clone()
        first_rank = ps.get_pipeline_model_parallel_first_rank()
        dist.broadcast(reference, first_rank, group=ps.get_embedding_group())
        assert torch.equal(reference, table)

    optimizer = optimizer_for(nn.ModuleList(chunks))
    sequence = config.seq_length
    spec = ActivationSpec((MICRO_BATCH, sequence, config.hidden_size))
    losses, norms = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        data = iter(micro_batches(config, step, num_micro_batches))
        if virtual is None:
            reported = forward_backward_pipelining_without_interleaving(
                forward_step, data, chunks[0], num_micro_batches, spec
            )
        else:
            reported = forward_backward_pipelining_with_interleaving(
                forward_step, data, chunks, num_micro_batches, spec
            )
        reduce_tied_embedding_gradients(chunks)
        _, norm, _ = optimizer.step()
        norms.append(norm)
        if reported:  # the last stage: the losses summed over micro-batches
            losses.append(reported["lm loss"].item() / num_micro_batches)
    assert norms == pytest.approx(expected_norms, rel=1e-5)
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        assert losses == pytest.approx(expected_losses, rel=1e-5)
    else:
        assert losses == []

    # Under single-process names, this rank's chunks are the matching part of the trained model.
    final = {}
    for chunk in chunks:
        final.update(stage_to_full_names(full_model_state_dict(chunk), chunk))
    for name, tensor in final.items():
        torch.testing.assert_close(tensor, expected_final[name], **TOLERANCE)
    return {"keys": sorted(final), "losses": losses, "expected": expected_losses}


CASES = {
    # name: (world size, pipeline, virtual, tensor, micro-batches, model overrides)
    "pp2_1f1b_tied": (2, 2, None, 1, 4, {}),
    "pp2_interleaved_tied": (2, 2, 2, 1, 4, {}),
    "pp2_interleaved_untied_rope": (
        2, 2, 2, 1, 6,
        dict(untie_embeddings_and_output_weights=True, position_embedding_type="rope"),
    ),
    "pp4_1f1b": (4, 4, None, 1, 5, {}),
    "tp2_pp2_1f1b": (4, 2, None, 2, 4, {}),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_pipeline_matches_single_process(case):
    world_size, *arguments = CASES[case]
    results = run_distributed(_pipeline_matches_single_process, world_size, *arguments)
    # Together the stages hold every tensor of the single-process model, each exactly once
    # per tensor-parallel rank.
    keys = [key for result in results for key in result["keys"]]
    tensor_parallel = arguments[2]
    assert len(keys) == tensor_parallel * len(set(keys))
    torch.manual_seed(1234)
    model = GPTModel(tiny_model_config(num_layers=LAYERS, **arguments[4]))
    assert set(keys) == set(model.state_dict())


def test_stage_layer_numbers_follow_megatron():
    assert [list(stage_layer_numbers(8, 2, rank)) for rank in range(2)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]
    # Interleaved, 2 stages x 2 chunks of 2 layers: rank 0 holds 0-1 and 4-5.
    assert [list(stage_layer_numbers(8, 2, 0, 2, chunk)) for chunk in range(2)] == [
        [0, 1],
        [4, 5],
    ]
    assert [list(stage_layer_numbers(8, 2, 1, 2, chunk)) for chunk in range(2)] == [
        [2, 3],
        [6, 7],
    ]
    with pytest.raises(ValueError, match="--num-layers 6 is not divisible by 4 pipeline stages"):
        stage_layer_numbers(6, 4, 0)
    with pytest.raises(ValueError, match=r"2 pipeline stages x 2 virtual stages \(= 4"):
        stage_layer_numbers(6, 2, 0, 2, 0)


def _interleaving_needs_divisible_micro_batches(rank: int, world_size: int) -> str:
    ps.initialize_model_parallel(
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2
    )
    with pytest.raises(ValueError) as error:
        forward_backward_pipelining_with_interleaving(
            forward_step, iter([]), [], 3, ActivationSpec((1, 1, 1))
        )
    return str(error.value)


def test_interleaving_needs_micro_batches_divisible_by_stages():
    message = run_distributed(_interleaving_needs_divisible_micro_batches, 2)[0]
    assert "number of micro-batches (3)" in message
    assert "--pipeline-model-parallel-size 2" in message


def _exchange(rank: int, world_size: int) -> list:
    # Two stages: the next and the previous rank are one peer, which sends both an activation
    # and a gradient at once; the tags keep them apart.
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    spec = ActivationSpec((2, 3))
    activation = torch.full((2, 3), 10.0 + rank)
    gradient = torch.full((2, 3), 20.0 + rank)
    from_prev, from_next = p2p.communicate(activation, gradient, True, True, spec)
    return [from_prev[0, 0].item(), from_next[0, 0].item(), from_prev.requires_grad]


def test_batched_exchange_keeps_activations_and_gradients_apart():
    assert run_distributed(_exchange, 2) == [[11.0, 21.0, True], [10.0, 20.0, True]]
