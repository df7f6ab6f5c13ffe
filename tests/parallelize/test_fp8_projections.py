"""--fp8-format's step (megatron.parallelize.fp8_projections): which products turn FP8, that the
parameters and checkpoint keys stay, and that each FP8 projection rounds like FP8 against its
bf16 twin, on one process and under tensor parallelism (CPU, torch._scaled_mm's CPU
kernels)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron.kernels.fp8_linear import Fp8Linear, Fp8Product, Fp8Recipe
from megatron.parallel import parallel_state as ps
from megatron.parallelize.fp8_projections import PROJECTION_NAMES, apply_fp8
from megatron.parallelize.gradient_sync import reduce_tied_embedding_gradients
from megatron.parallelize.steps import apply_activation_recomputation, split_pipeline
from megatron.pipeline.p2p import ActivationSpec
from megatron.pipeline.schedules import forward_backward_pipelining_without_interleaving
from megatron.pipeline.stages import stage_to_full_names
from megatron.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    all_reduce_sequence_parallel_grads,
    gather_tensor_model_parallel_weight,
)
from moe.config import MoEConfig
from moe.mlp_spec import MoEMlpSpec
from tests.fp8_closeness import assert_fp8_follows_bf16
from tests.kernels.test_fp8_linear import pytestmark as needs_cpu_scaled_mm
from tests.launch import run_distributed
from tests.pipeline.test_pipeline_parallel import micro_batches
from tests.tiny_gpt import bf16_autocast_loss, sharded_gpt_model, tiny_model_config

pytestmark = needs_cpu_scaled_mm
RECIPE = Fp8Recipe("rowwise", "hybrid")


def _model(**overrides) -> nn.Module:
    torch.manual_seed(0)
    return sharded_gpt_model(tiny_model_config(hidden_size=64, ffn_hidden_size=128, **overrides))


def test_the_projections_turn_fp8_and_nothing_else():
    model = _model()
    before = dict(model.state_dict(keep_vars=True))
    apply_fp8(model, RECIPE)
    fp8 = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert fp8 == set(PROJECTION_NAMES)
    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == 4 * 2  # 4 per layer
    assert type(model.embedding.word_embeddings) is nn.Embedding
    # The same parameter objects under the same keys: checkpoints move either way.
    after = dict(model.state_dict(keep_vars=True))
    assert after.keys() == before.keys()
    assert all(after[key] is before[key] for key in before)


def test_every_projection_rounds_like_fp8_and_the_gradients_follow_bf16():
    """Each projection, on the operands the FP8 model gave it, against its bf16 twin's
    (tests/fp8_closeness.py): output, input and weight gradients each moved by FP8's
    rounding, neither less (a projection left in bf16) nor more (a wrong scale); every
    parameter's gradient near the bf16 model's. The weight gradients stay fp32, as the master
    weights."""
    model = apply_fp8(_model(), RECIPE)
    errors = assert_fp8_follows_bf16(_model(), model)
    assert len(errors) == 4 * 2  # the projections of both layers
    assert model.decoder.layers[0].mlp.linear_fc1.weight.grad.dtype == torch.float32


def _sum_sequence_parallel_grads(model: nn.Module) -> None:
    """The norms' gradients, partial on each rank under sequence parallelism, summed."""
    all_reduce_sequence_parallel_grads(model.parameters())


def _tensor_parallel_layers(rank: int, world_size: int, sequence_parallel: bool) -> None:
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    layout = dict(tensor_model_parallel_size=world_size, sequence_parallel=sequence_parallel)
    model = apply_fp8(_model(**layout), RECIPE)
    products = [
        m.product
        for m in model.modules()
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
    ]
    assert len(products) == 4 * 2  # tied embeddings: no output layer of its own
    assert all(isinstance(product, Fp8Product) for product in products)
    assert_fp8_follows_bf16(_model(**layout), model, _sum_sequence_parallel_grads)
    ps.destroy_model_parallel()


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sp"])
def test_fp8_composes_with_tensor_parallelism(sequence_parallel):
    """The whole model at TP2: each rank's share of every projection, on the operands the
    FP8 model gave it, against the bf16 model's at the same layout, within FP8's rounding
    (tests/fp8_closeness.py; the ranks quantize with one process's scales: the test below),
    and every gradient near bf16's."""
    run_distributed(_tensor_parallel_layers, 2, sequence_parallel)


def _fp8_mlp(fc1: nn.Module, fc2: nn.Module, recipe: Fp8Recipe) -> nn.Module:
    """fc2(gelu(fc1(x))) with FP8 projections: a dense MLP's shape, without the model's bf16."""
    mlp = nn.Sequential()
    mlp.linear_fc1, mlp.gelu, mlp.linear_fc2 = fc1, nn.GELU(), fc2
    return apply_fp8(mlp, recipe)


def _mlp_products(mlp: nn.Module) -> list:
    """The MLP's output, input gradient and weight gradients on fixed fp32 data."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(32, 64, generator=generator, requires_grad=True)
    y = mlp(x)
    y.backward(torch.randn(y.shape, generator=generator))
    return [y.detach(), x.grad, mlp.linear_fc1.weight.grad, mlp.linear_fc2.weight.grad]


def _dense_linears() -> tuple:
    torch.manual_seed(0)
    return nn.Linear(64, 128, bias=False), nn.Linear(128, 64, bias=False)


def _tensor_parallel_mlp_products(rank: int, world_size: int, recipe: Fp8Recipe) -> list:
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    fc1, fc2 = _dense_linears()
    mlp = _fp8_mlp(
        ColumnParallelLinear.from_linear(fc1), RowParallelLinear.from_linear(fc2), recipe
    )
    y, grad_x, grad_fc1, grad_fc2 = _mlp_products(mlp)
    full = [
        gather_tensor_model_parallel_weight(grad_fc1, 0),
        gather_tensor_model_parallel_weight(grad_fc2, 1),
    ]
    ps.destroy_model_parallel()
    return [y, grad_x, *full]


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_tensor_parallel_products_quantize_with_one_process_scales(scaling, fmt):
    """The ranks take the maximum of every amax that spans a split dimension, so a column- then
    row-parallel MLP quantizes exactly as one process: in fp32 only the order of sums differs
    (each rank quantizing its own shard instead differs by FP8's rounding, about 3%)."""
    recipe = Fp8Recipe(scaling, fmt)
    expected = _mlp_products(_fp8_mlp(*_dense_linears(), recipe))
    products = run_distributed(_tensor_parallel_mlp_products, 2, recipe)
    for name, actual, wanted in zip(["y", "dx", "dw1", "dw2"], products[0], expected):
        torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-5, msg=name)


def _compiled_tensor_parallel_mlp(rank: int, world_size: int) -> list:
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    fc1, fc2 = _dense_linears()
    parallel = ColumnParallelLinear.from_linear(fc1), RowParallelLinear.from_linear(fc2)
    mlp = _fp8_mlp(*parallel, RECIPE)
    eager = _mlp_products(mlp)
    mlp.zero_grad(set_to_none=True)
    compiled = _mlp_products(torch.compile(mlp, fullgraph=True, dynamic=False))
    ps.destroy_model_parallel()
    return [(got - wanted).abs().max().item() for got, wanted in zip(compiled, eager)]


def test_tensor_parallel_fp8_products_compile_as_one_graph():
    """The amax all-reduces inside the FP8 products trace with them: one graph per rank,
    the eager products up to the order of fp32 sums."""
    for differences in run_distributed(_compiled_tensor_parallel_mlp, 2, timeout_s=300):
        assert max(differences) < 1e-4, differences


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_fp8_composes_with_activation_recomputation(granularity):
    """The recomputed forward quantizes the same tensors the same way: the gradients are the
    ones without recomputation, exactly."""
    grads = []
    for recompute in ({}, {"recompute_granularity": granularity}):
        if granularity == "full" and recompute:
            recompute.update(recompute_method="uniform", recompute_num_layers=1)
        model = apply_fp8(_model(**recompute), RECIPE)
        apply_activation_recomputation(model, model.config).train()
        bf16_autocast_loss(model).backward()
        grads.append({name: param.grad for name, param in model.named_parameters()})
    for name, grad in grads[0].items():
        assert torch.equal(grads[1][name], grad), name


def test_the_fp8_model_compiles_as_one_graph():
    """torch.compile traces a model with FP8 projections whole (a graph break around each
    projection would cost more than FP8 saves) and computes the eager loss."""
    model = apply_fp8(_model(num_layers=1), RECIPE)
    eager = bf16_autocast_loss(model)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    loss = bf16_autocast_loss(compiled)
    loss.backward()
    torch.testing.assert_close(loss, eager, rtol=1e-3, atol=0)


def _pipeline_fp8(rank: int, world_size: int) -> dict:
    """One step of a 2-stage 1F1B pipeline over a model whose projections were made FP8 before
    the split (as parallelize orders the steps), against the same model on one process."""
    config = tiny_model_config(num_layers=4, hidden_size=64, ffn_hidden_size=128)
    batches = micro_batches(config, 0, 4)

    def forward_step(model, batch):
        output = model(batch["tokens"], labels=batch["labels"])
        if not model.post_process:
            return output, {}
        loss = output.mean()
        return loss, {"lm loss": loss.detach()}

    torch.manual_seed(0)
    whole = apply_fp8(sharded_gpt_model(config), RECIPE)
    expected_loss = 0.0
    for batch in batches:
        loss, _ = forward_step(whole, batch)
        (loss / len(batches)).backward()
        expected_loss += loss.item() / len(batches)
    expected_grads = {name: param.grad for name, param in whole.named_parameters()}

    ps.initialize_model_parallel(pipeline_model_parallel_size=world_size)
    torch.manual_seed(0)
    chunk = split_pipeline(apply_fp8(sharded_gpt_model(config), RECIPE))[0]
    assert any(isinstance(module, Fp8Linear) for module in chunk.modules())
    spec = ActivationSpec((batches[0]["tokens"].shape[0], config.seq_length, config.hidden_size))
    reported = forward_backward_pipelining_without_interleaving(
        forward_step, iter(batches), chunk, len(batches), spec
    )
    reduce_tied_embedding_gradients([chunk])
    grads = stage_to_full_names({n: p.grad for n, p in chunk.named_parameters()}, chunk)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-6)
    ps.destroy_model_parallel()
    loss = reported["lm loss"].item() / len(batches) if reported else None
    return {"loss": loss, "expected": expected_loss}


def test_fp8_composes_with_pipeline_parallelism():
    """Each stage quantizes the same tensors as one process: the losses and every gradient are
    one process's FP8 ones."""
    results = run_distributed(_pipeline_fp8, 2)
    assert results[0]["loss"] is None
    assert results[1]["loss"] == pytest.approx(results[1]["expected"], rel=1e-6)


def test_in_a_dmoe_model_the_shared_expert_turns_fp8_and_the_router_does_not():
    """The MoE layer's shared expert is a dense MLP (its projections turn FP8); the router's
    gate stays as it is (the experts' own FP8 comes from the MLP spec's styles:
    tests/moe/test_fp8_experts.py)."""
    config = tiny_model_config(hidden_size=64, ffn_hidden_size=128)
    moe = MoEConfig(num_experts=4, top_k=2, shared_expert=True)
    torch.manual_seed(0)
    model = apply_fp8(sharded_gpt_model(config, MoEMlpSpec(moe)), RECIPE)
    mlp = model.decoder.layers[0].mlp
    assert isinstance(mlp.shared_expert.linear_fc1, Fp8Linear)
    assert isinstance(mlp.shared_expert.linear_fc2, Fp8Linear)
    assert type(mlp.router.layer) is nn.Linear
    assert isinstance(model.decoder.layers[0].self_attention.linear_qkv, Fp8Linear)
