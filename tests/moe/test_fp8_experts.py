"""Which MoE layers' expert products turn FP8 (moe.fp8_experts, through the MLP spec's FP8
styles), and a dMoE model with FP8 experts: each FP8 layer within FP8's rounding of its bf16
twin, one process's losses under expert parallelism and its scales under tensor parallelism.
On the CPU the FP8 grouped products dequantize and multiply in fp32
(moe.kernels.fp8_grouped_gemm); the run-level GPU test is tests/parallel/test_gpu_fp8.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from megatron.kernels.fp8_linear import Fp8Recipe
from megatron.parallel import parallel_state
from megatron.parallelize.fp8_projections import apply_fp8
from moe.config import MoEConfig
from moe.experts import refresh_compute_weights
from moe.kernels.grouped_gemm import MOE, TORCH
from moe.mlp_spec import MoEMlpSpec
from tests.fp8_closeness import assert_fp8_follows_bf16
from tests.launch import run_distributed
from tests.markers import needs_torch_grouped_mm
from tests.tiny_gpt import bf16_autocast_loss, sharded_gpt_model, tiny_model_config

pytestmark = needs_torch_grouped_mm
RECIPE = Fp8Recipe("rowwise", "hybrid")
# The grouped GEMM a Hopper run chooses (moe.kernels.grouped_gemm.choose_backend): the one
# whose products have an FP8 form. On the CPU torch._grouped_mm runs it too.
DMOE = MoEConfig(num_experts=4, top_k=2, grouped_gemm=TORCH)


def _model(
    moe: MoEConfig = DMOE, fp8: bool = True, recipe: Fp8Recipe = RECIPE, **overrides
) -> nn.Module:
    torch.manual_seed(0)
    spec = MoEMlpSpec(moe)
    config = tiny_model_config(hidden_size=64, ffn_hidden_size=128, **overrides)
    model = sharded_gpt_model(config, spec)
    return apply_fp8(model, recipe, spec.fp8_styles()) if fp8 else model


def _experts(model: nn.Module):
    return [layer.mlp.experts for layer in model.decoder.layers]


def test_the_dmoe_experts_turn_fp8_on_the_grouped_gemm_that_has_an_fp8_form(capsys):
    model = _model()
    assert all(experts.fp8 == RECIPE for experts in _experts(model))
    assert "stays in bf16" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "moe, reason",
    [
        (dataclasses.replace(DMOE, grouped_gemm=MOE), "this run's is moe.kernels.grouped_gemm"),
        (dataclasses.replace(DMOE, mlp_impl="sparse"), "--moe-impl sparse has no FP8 products"),
        (dataclasses.replace(DMOE, dropless=False), "the MoE with capacity's batched expert"),
    ],
    ids=["triton-grouped-gemm", "block-sparse", "capacity"],
)
def test_other_expert_products_stay_bf16_and_the_run_says_why_once(moe, reason, capsys):
    model = _model(moe)
    assert all(experts.fp8 is None for experts in _experts(model))
    lines = [line for line in capsys.readouterr().out.splitlines() if "stays in bf16" in line]
    assert len(lines) == 1 and reason in lines[0], lines  # two layers, one line


def test_every_fp8_layer_of_the_dmoe_rounds_like_fp8_and_its_gradients_follow_bf16():
    """Each layer's grouped experts and each projection, on the operands the FP8 model gave
    it, against its bf16 twin's (tests/fp8_closeness.py): output, input and router-weight
    gradients and expert weight gradients each moved by FP8's rounding, neither less (a layer
    left in bf16) nor more (a wrong scale, a dead expert); every parameter's gradient near
    the bf16 model's. The expert weights' gradients stay fp32, as their master weights."""
    model = _model()
    errors = assert_fp8_follows_bf16(_model(fp8=False), model)
    experts = [name for name in errors if name.endswith("experts")]
    assert len(experts) == 2 and all("w2 gradient" in errors[name] for name in experts)
    assert all(expert.w1.grad.dtype == torch.float32 for expert in _experts(model))


def _expert_parallel_loss(rank: int, world_size: int) -> dict:
    """The FP8 dMoE's loss and expert gradients with its experts split over `world_size` ranks,
    the same tokens on every rank, exchanged in one fixed-size block (the experts run once)."""
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world_size)
    try:
        model = _model(dataclasses.replace(DMOE, expert_parallel_buffer_factor=2.0))
        loss = bf16_autocast_loss(model)
        loss.backward()
        return {"loss": loss.item(), "w1_grad": _experts(model)[0].w1.grad.clone()}
    finally:
        parallel_state.destroy_model_parallel()


def test_fp8_experts_under_expert_parallelism_give_one_process_losses():
    """Rowwise scales are per row and per (expert, column): splitting the experts over ranks
    quantizes every operand as one process does, so the loss is one process's and each rank's
    expert gradients are one process's for the rows of both ranks (twice the same tokens)."""
    [single] = run_distributed(_expert_parallel_loss, 1)
    results = run_distributed(_expert_parallel_loss, 2)
    local = DMOE.num_experts // 2
    for rank, result in enumerate(results):
        assert result["loss"] == pytest.approx(single["loss"], rel=1e-6)
        expected = 2 * single["w1_grad"][rank * local : (rank + 1) * local]
        torch.testing.assert_close(result["w1_grad"], expected, rtol=1e-5, atol=1e-8)


def _held_weight_scales(rank: int, world_size: int, scaling: str) -> tuple:
    """The inverse scales of the first layer's FP8 expert weights that span the ffn channels
    (w1's input-gradient copy, w2's forward copy), each expert's channels split over
    `world_size` tensor-parallel ranks."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        recipe = Fp8Recipe(scaling, "hybrid")
        model = _model(recipe=recipe, tensor_model_parallel_size=world_size)
        refresh_compute_weights(model, torch.bfloat16, accumulate_in_place=False)
        w1, _, w2 = _experts(model)[0]._fp8_weights
        return w1.backward_inverse, w2.forward_inverse
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_experts_under_tensor_parallelism_quantize_with_one_process_scales(scaling):
    """Each tensor-parallel rank holds a slice of every expert's ffn channels; the amax over
    those channels is the maximum over the ranks, so the weights are quantized with one
    process's scales (moe.kernels.fp8_grouped_gemm's products take the same for x and dy)."""
    [single] = run_distributed(_held_weight_scales, 1, scaling)
    for scales in run_distributed(_held_weight_scales, 2, scaling):
        assert all(torch.equal(got, wanted) for got, wanted in zip(scales, single))


def _step_with_copies(refresh: bool) -> tuple:
    """Two SGD steps of the FP8 dMoE, its bf16 expert copies refreshed before each (the
    trainer's once-per-step refresh, which also quantizes them) or not at all (the products
    quantize the weights in every call); the losses and the last expert gradient."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(2):
        if refresh:
            refresh_compute_weights(model, torch.bfloat16, accumulate_in_place=False)
            assert all(experts._fp8_weights is not None for experts in _experts(model))
        optimizer.zero_grad()
        loss = bf16_autocast_loss(model)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, _experts(model)[1].w2.grad


def test_weights_quantized_once_per_step_give_the_products_quantized_in_every_call():
    """The copies' FP8 forms, kept from one refresh to the next (refreshed in place after the
    first step's update), are what each product would quantize itself."""
    held_losses, held_grad = _step_with_copies(refresh=True)
    losses, grad = _step_with_copies(refresh=False)
    assert held_losses == losses
    torch.testing.assert_close(held_grad, grad, rtol=0, atol=0)


def test_the_memory_optimized_mlp_recomputes_the_same_fp8_products():
    """--moe-memory-optimized-mlp recomputes the activation and the second product in the
    backward: with the weights kept quantized (a refresh), the recomputed FP8 product finds its
    weight's FP8 form again and gives the same loss and gradients."""
    results = []
    for memory_optimized in (False, True):
        model = _model(dataclasses.replace(DMOE, memory_optimized_mlp=memory_optimized))
        refresh_compute_weights(model, torch.bfloat16, accumulate_in_place=False)
        loss = bf16_autocast_loss(model)
        loss.backward()
        results.append((loss.item(), _experts(model)[0].w2.grad))
    assert results[0][0] == results[1][0]
    torch.testing.assert_close(results[1][1], results[0][1], rtol=0, atol=0)
