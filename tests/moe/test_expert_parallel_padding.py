"""The fixed-size blocks' padding (moe.exchange.fixed_blocks) costs wire time only: at the layer
level, on gloo, no grouped product and no activation of the dMoE reads a padding row, forward or
backward.

Equal numbers alone cannot show it: padding computed as zeros (the block-sparse backend's way)
adds exactly nothing. So the layer runs twice, the second time with NaN in every slot of the
exchange buffers that no row fills, zero-filled or not: a product that counted one in its groups
would spread NaN into the expert gradients. And the rows each product and the activation are
told to compute are recorded: the real ones, not the blocks' capacity.
"""

from __future__ import annotations

import pytest
import torch

from megatron.parallel import parallel_state
from moe import experts as experts_module
from moe.exchange import fixed_blocks
from moe.kernels.grouped_gemm import MOE as MOE_GEMM
from moe.kernels.grouped_gemm import TORCH, GroupedGemmBackend
from tests.launch import run_distributed
from tests.markers import needs_torch_grouped_mm
from tests.moe.test_expert_parallel import EXPERTS, local_loss, make_layer, make_tokens, probe

pytestmark = pytest.mark.usefixtures("reference_kernels")

_scatter_to_slots = fixed_blocks._scatter_to_slots


def _scatter_with_nan_padding(rows, send_slot, slots, fill):
    """`_scatter_to_slots` with NaN in every slot no row lands in, `fill` or not."""
    buffer = _scatter_to_slots(rows, send_slot, slots, fill)
    empty = torch.ones(slots + 1, dtype=torch.bool, device=rows.device)
    empty[send_slot] = False
    return buffer.masked_fill(empty[:slots].view((-1,) + (1,) * (rows.dim() - 1)), float("nan"))


def _scatter_with_nan_in_unfilled_slots(rows, send_slot, slots, fill):
    """NaN only where the layer did not ask for zeros (`fill` False): what an unfilled buffer
    may hold."""
    if fill:
        return _scatter_to_slots(rows, send_slot, slots, fill)
    return _scatter_with_nan_padding(rows, send_slot, slots, fill)


def _recording(calls: list):
    """grouped_product and scaled_activation as moe.experts calls them, each call recorded as
    (name, rows given, rows to compute: the groups' total or the activation's valid rows)."""
    product, activation = experts_module.grouped_product, experts_module.scaled_activation

    def grouped_product(x, weight, tokens_per_expert, offsets, backend):
        calls.append(("product", x.shape[0], int(offsets[-1])))
        return product(x, weight, tokens_per_expert, offsets, backend)

    def scaled_activation(h, scale, name, valid=None):
        calls.append(("activation", h.shape[0], h.shape[0] if valid is None else int(valid[0])))
        return activation(h, scale, name, valid)

    return grouped_product, scaled_activation


def _step_with_poisoned_padding(
    rank: int, world_size: int, impl: str, grouped_gemm: GroupedGemmBackend, poison
) -> dict:
    """For one exchange and for two chunks: the layer's step (output, input and parameter
    gradients) with clean buffers and with `poison` as the buffers' scatter, the calls of the
    products and the activation in the poisoned step, and this rank's routing counts."""
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world_size)
    try:
        results = {}
        for chunks in (1, 2):
            overrides = {
                "expert_parallel_buffer_factor": 4.0,
                "grouped_gemm": grouped_gemm,
                "expert_parallel_chunks": chunks,
            }
            steps, calls = {}, []
            for poisoned in (False, True):
                calls.clear()
                layer = make_layer(impl, 2, world_size, None, **overrides)
                tokens = make_tokens(world_size, None)[rank : rank + 1].clone()
                tokens.requires_grad_(True)
                with pytest.MonkeyPatch.context() as patch:
                    grouped_product, scaled_activation = _recording(calls)
                    patch.setattr(experts_module, "grouped_product", grouped_product)
                    patch.setattr(experts_module, "scaled_activation", scaled_activation)
                    if poisoned:
                        patch.setattr(fixed_blocks, "_scatter_to_slots", poison)
                    loss, output = local_loss(layer, tokens, probe(world_size)[rank : rank + 1])
                    loss.backward()
                steps[poisoned] = {"output": output.detach(), "input_grad": tokens.grad}
                steps[poisoned].update((n, p.grad) for n, p in layer.named_parameters())
            results[chunks] = {
                "clean": steps[False],
                "poisoned": steps[True],
                "calls": list(calls),
                "tokens_per_expert": layer.tokens_per_expert.clone(),
            }
        return results
    finally:
        parallel_state.destroy_model_parallel()


def _check_padding_untouched(impl: str, grouped_gemm: GroupedGemmBackend, poison) -> list:
    """Each rank's output and gradients are bit for bit the same with the padding poisoned;
    returns the ranks' results."""
    results = run_distributed(_step_with_poisoned_padding, 2, impl, grouped_gemm, poison)
    for rank, by_chunks in enumerate(results):
        for chunks, result in by_chunks.items():
            clean, poisoned = result["clean"], result["poisoned"]
            changed = [name for name in clean if not torch.equal(clean[name], poisoned[name])]
            assert not changed, (
                f"rank {rank}, {chunks} chunk(s): {changed} change with NaN in the padding rows "
                f"(non-finite: {[n for n in changed if not poisoned[n].isfinite().all()]})"
            )
    return results


@pytest.mark.parametrize(
    "grouped_gemm, kernels",
    [
        (MOE_GEMM, "reference_kernels"),
        (MOE_GEMM, "triton_kernels"),
        pytest.param(TORCH, "reference_kernels", marks=needs_torch_grouped_mm),
    ],
    ids=["grouped_references", "grouped_triton", "grouped_torch_grouped_mm"],
)
def test_grouped_products_leave_the_padding_rows_alone(request, grouped_gemm, kernels):
    """--moe-impl grouped with fixed-size blocks, in one exchange and in two chunks: with NaN in
    every padding slot of the send buffers and of the gradients' buffers, the output and every
    gradient are bit for bit the clean run's; each product and the activation compute only the
    rows the ranks routed to this rank's experts, of the whole buffer they are given."""
    request.getfixturevalue(kernels)
    results = _check_padding_untouched("grouped", grouped_gemm, _scatter_with_nan_padding)
    local = EXPERTS // 2
    for rank, by_chunks in enumerate(results):
        for chunks, result in by_chunks.items():
            routed = sum(
                int(r[chunks]["tokens_per_expert"][rank * local : (rank + 1) * local].sum())
                for r in results
            )
            calls = result["calls"]
            # Per chunk: the two products (w1, w2) and the activation between them.
            assert [name for name, _, _ in calls] == ["product", "activation", "product"] * chunks
            for name, per_chunk in (("product", 2), ("activation", 1)):
                given = sum(rows for n, rows, _ in calls if n == name)
                computed = sum(rows for n, _, rows in calls if n == name)
                assert computed == per_chunk * routed < given, (
                    f"rank {rank}, {chunks} chunk(s): the {name}s compute {computed} rows of "
                    f"{given}; {routed} were routed here ({calls})"
                )


def test_block_sparse_products_get_the_padding_as_zeros():
    """--moe-impl sparse computes every row of the blocks, the padding too (counted in the last
    local expert): the layer zero-fills those buffers, so that with NaN wherever it asked for
    none, the output and every gradient are still the clean run's."""
    _check_padding_untouched("sparse", MOE_GEMM, _scatter_with_nan_in_unfilled_slots)
