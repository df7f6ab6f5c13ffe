"""The MoE kernels on a GPU at real shapes, against their PyTorch references on the same GPU.

The CPU suite runs the same kernels in Triton's interpreter at small shapes; these run them
compiled, at the sizes of the issue's benchmark configurations (16,384 tokens, 64 experts, top-2,
hidden 1024; block-sparse with 128-blocks), where tiling, masking and multi-program reductions
are exercised for real. Run with `pytest -m gpu tests/moe` on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch

from megatron.config import ModelConfig
from moe.config import MoEConfig
from moe.kernels import permute
from moe.kernels.block_sparse import Topology, dds_t, dsd, dsd_t, sdd
from moe.kernels.block_sparse import reference as block_reference
from moe.layers import build_moe_layer
from tests.conftest import force_kernel_mode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]

TOKENS, TOP_K, EXPERTS, HIDDEN = 16384, 2, 64, 1024


@pytest.fixture(autouse=True)
def compiled_kernels(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    force_kernel_mode(monkeypatch, "triton")


def _relative_error(value: torch.Tensor, exact: torch.Tensor) -> float:
    return ((value.double() - exact.double()).norm() / exact.double().norm()).item()


def _routing(seed: int = 0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    # Skewed loads, and the last expert empty: uneven bins, as a trained router gives.
    probabilities = torch.linspace(1.0, 3.0, EXPERTS, device="cuda")
    probabilities[-1] = 0
    expert_indices = torch.multinomial(
        probabilities, TOKENS * TOP_K, replacement=True, generator=generator
    ).int()
    return expert_indices


def _permutation():
    expert_indices = _routing(1)
    counts = torch.bincount(expert_indices, minlength=EXPERTS).int()
    _, indices = torch.sort(expert_indices, stable=True)
    return indices.int(), torch.cumsum(counts, 0).int(), counts


def _run(op, x, *args):
    """op(x, *args) and the gradient of x (and of any float args) for a fixed output gradient."""
    inputs = [x.detach().requires_grad_()] + [
        a.detach().requires_grad_() if torch.is_tensor(a) and a.is_floating_point() else a
        for a in args
    ]
    out = op(*inputs)
    generator = torch.Generator(device="cuda").manual_seed(7)
    grad = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=generator)
    out.backward(grad)
    grads = [t.grad for t in inputs if torch.is_tensor(t) and t.requires_grad]
    return out.detach(), grads


def test_gather_and_scatter_match_the_reference():
    """The padded layout's (the block-sparse dMoE's)."""
    indices, bins, counts = _permutation()
    generator = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=generator)
    weights = torch.rand(TOKENS, TOP_K, device="cuda", dtype=torch.bfloat16, generator=generator)
    padded = permute.padded_bins(counts, 128)
    gather = (
        permute.padded_gather,
        permute.padded_gather_reference,
        (indices, bins, padded, TOP_K),
    )
    scatter = (
        permute.padded_scatter,
        permute.padded_scatter_reference,
        (indices, weights, bins, padded, TOP_K),
    )
    kernel, reference, args = gather
    rows, (grad_x,) = _run(kernel, x, *args)
    want_rows, (want_grad_x,) = _run(reference, x, *args)
    assert torch.equal(rows, want_rows)  # a copy: exact
    assert _relative_error(grad_x, want_grad_x) < 1e-2  # top-2 rows summed, in another order
    kernel, reference, args = scatter
    y = torch.randn(rows.shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    out, grads = _run(kernel, y, *args)
    want_out, want_grads = _run(reference, y, *args)
    assert _relative_error(out, want_out) < 1e-2
    assert len(grads) == len(want_grads) == 2  # the rows and the router weights
    for got, want in zip(grads, want_grads):
        assert _relative_error(got, want) < 1e-2


def test_block_sparse_products_match_the_reference():
    block, ffn, experts = 128, 1024, 16
    generator = torch.Generator(device="cuda").manual_seed(5)
    tokens = torch.randint(1, 4 * block, (experts,), device="cuda", generator=generator)
    tokens[3] = 0
    padded_bins = ((tokens + block - 1) // block * block).cumsum(0).int()
    topology = Topology.from_padded_bins(padded_bins, ffn, block)
    rows = int(padded_bins[-1])

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=generator)

    x, w1 = randn(rows, HIDDEN), randn(HIDDEN, experts * ffn)
    data = sdd(x, w1, topology)
    assert (
        _relative_error(data, block_reference.sdd_reference(x.float(), w1.float(), topology)) < 1e-2
    )
    w2, y = randn(experts * ffn, HIDDEN), randn(rows, HIDDEN)
    for got, want in (
        (dsd(data, topology, w2), block_reference.dsd_reference(data.float(), topology, w2.float())),
        (dsd_t(data, topology, y), block_reference.dsd_t_reference(data.float(), topology, y.float())),
        (dds_t(x, data, topology), block_reference.dds_t_reference(x.float(), data.float(), topology)),
    ):  # fmt: skip
        assert _relative_error(got, want) < 1e-2


@pytest.mark.parametrize(
    "impl, dropless", [("grouped", True), ("sparse", True), ("grouped", False)]
)
def test_layer_backends_match_the_loop_reference_in_fp32(impl, dropless):
    """Every kernel of a backend at once (sort, permutations, grouped GEMM or block-sparse
    products, forward and backward) against the per-expert loop, in fp32."""
    hidden, ffn, experts, top_k, tokens = 1024, 2048, 16, 2, 4096
    model = ModelConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=16, ffn_hidden_size=ffn,
        seq_length=tokens, max_position_embeddings=tokens, add_bias_linear=False,
    )  # fmt: skip
    results = []
    for name in (impl, "reference"):
        moe = MoEConfig(
            num_experts=experts, top_k=top_k, mlp_impl=name, dropless=dropless,
            capacity_factor=1.0,
        )  # fmt: skip
        torch.manual_seed(0)
        layer = build_moe_layer(model, moe).cuda()
        generator = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(1, tokens, hidden, device="cuda", generator=generator)
        x.requires_grad_()
        out = layer(x)
        out.square().mean().backward()
        results.append(
            [out.detach(), x.grad, layer.experts.w1.grad, layer.experts.w2.grad,
             layer.router.layer.weight.grad]
        )  # fmt: skip
    for got, want in zip(*results):
        assert _relative_error(got, want) < 1e-4


@pytest.mark.parametrize("top_k", [2, 8])
def test_token_rows_kernels_match_the_reference(top_k):
    """moe.kernels.token_rows at the issue's top-8 size (16,384 tokens, hidden 2048), bf16."""
    from moe.kernels import token_rows

    tokens, hidden = 16384, 2048
    generator = torch.Generator(device="cuda").manual_seed(top_k)
    scores = torch.rand(tokens, EXPERTS, device="cuda", generator=generator)
    expert_indices = scores.topk(top_k, dim=-1).indices
    order, slot_of, _ = token_rows.sort_assignments(expert_indices, EXPERTS)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
    y = torch.randn(tokens * top_k, hidden, device="cuda", dtype=torch.bfloat16)

    assert torch.equal(
        token_rows.gather_rows(x, order, slot_of, top_k),
        token_rows.gather_rows_reference(x, order, top_k),
    )
    summed = token_rows.sum_rows(y, order, slot_of, top_k)
    assert _relative_error(summed, token_rows.sum_rows_reference(y, slot_of, top_k)) < 1e-2


@pytest.mark.parametrize("experts,columns", [(8, 14336), (64, 1024)])
def test_group_column_amax_kernel_gives_the_reference_exactly(experts, columns):
    """moe.kernels.group_amax at the FP8 weight gradient's sizes (16,384 rows, Mixtral-shaped
    and 64 experts), uneven groups, bf16: a maximum has no rounding, so exactly."""
    from moe.kernels.group_amax import group_column_amax, group_column_amax_reference

    generator = torch.Generator(device="cuda").manual_seed(experts)
    rows = torch.randn(16384, columns, device="cuda", generator=generator).bfloat16()
    weights = torch.rand(experts, device="cuda", generator=generator)
    counts = (weights / weights.sum() * 16000).floor().to(torch.int32)
    offsets = counts.cumsum(0).to(torch.int32)
    assert torch.equal(group_column_amax(rows, offsets), group_column_amax_reference(rows, offsets))


@pytest.mark.parametrize("activation", ["gelu", "silu"])
@pytest.mark.parametrize("rows,width", [(131072, 1024), (16384, 3072)])
def test_scaled_activation_kernels_match_the_reference(activation, rows, width):
    """moe.kernels.scaled_activation at the layer's sizes (top-8 and top-1 configurations), bf16:
    forward, input gradient and the scale's gradient against the eager reference."""
    from moe.kernels import scaled_activation as sa

    generator = torch.Generator(device="cuda").manual_seed(rows)
    h = 3 * torch.randn(rows, width, device="cuda", generator=generator)
    h = h.to(torch.bfloat16)
    scale = torch.rand(rows, device="cuda", generator=generator)
    grad = torch.randn(rows, width, device="cuda", generator=generator).to(torch.bfloat16)
    got_out = sa._scaled_activation_triton(h, scale, activation)
    got_grads = sa._scaled_activation_backward_triton(grad, h, scale, activation)
    want_out = sa.scaled_activation_reference(h, scale, activation)
    want_grads = sa.scaled_activation_backward_reference(grad, h, scale, activation)
    # The same math with another tanh/exp: a value may round to the neighbouring bf16.
    assert _relative_error(got_out, want_out) < 5e-3
    assert _relative_error(got_grads[0], want_grads[0]) < 5e-3
    assert _relative_error(got_grads[1], want_grads[1]) < 1e-4


def test_padding_is_neither_read_nor_written_at_the_layer_sizes():
    """The expert-parallel blocks' padding (moe.exchange.fixed_blocks) at the dMoE 125M's EP4
    sizes (65,536 rows per micro-batch at F = 1.5 over 4 ranks, 45,056 of them real; h 768, ffn
    3072), bf16: permute_rows and the scaled activation give the reference on the real rows and
    leave the padding rows' prefilled marker, forward and backward."""
    from moe.kernels import scaled_activation as sa
    from moe.kernels import token_rows

    generator = torch.Generator(device="cuda").manual_seed(0)
    rows, real = 98304, 45056
    valid = torch.tensor([real], device="cuda", dtype=torch.int32)
    index = torch.randperm(rows, device="cuda", generator=generator)
    x = torch.randn(rows, 768, device="cuda", generator=generator).bfloat16()
    for by_source in (False, True):
        out = torch.full((rows, 768), float("nan"), device="cuda", dtype=torch.bfloat16)
        token_rows.permute_rows_triton(x, index, valid, by_source, out=out)
        counted = (index if by_source else torch.arange(rows, device="cuda")) < real
        assert torch.equal(out[counted], x[index][counted])
        assert torch.isnan(out[~counted]).all()
    h = (3 * torch.randn(rows, 3072, device="cuda", generator=generator)).bfloat16()
    scale = torch.rand(rows, device="cuda", generator=generator)
    grad = torch.randn(rows, 3072, device="cuda", generator=generator).bfloat16()
    out = torch.full_like(h, float("nan"))
    sa._scaled_activation_triton(h, scale, "gelu", valid, out=out)
    grads = (torch.full_like(h, float("nan")), torch.full_like(scale, float("nan")))
    sa._scaled_activation_backward_triton(grad, h, scale, "gelu", valid, outputs=grads)
    want_out = sa.scaled_activation_reference(h[:real], scale[:real], "gelu")
    want_grads = sa.scaled_activation_backward_reference(
        grad[:real], h[:real], scale[:real], "gelu"
    )
    assert _relative_error(out[:real], want_out) < 5e-3
    assert _relative_error(grads[0][:real], want_grads[0]) < 5e-3
    assert _relative_error(grads[1][:real], want_grads[1]) < 1e-4
    for written in (out, *grads):
        assert torch.isnan(written[real:]).all()


@pytest.mark.parametrize("tokens,experts,k", [(65536, 64, 8), (16384, 64, 2), (8192, 8, 2)])
def test_router_topk_kernel_matches_the_reference(tokens, experts, k):
    from moe.kernels import router_topk

    generator = torch.Generator(device="cuda").manual_seed(tokens + k)
    logits = torch.randn(tokens, experts, device="cuda", generator=generator)
    for scores in (logits.softmax(-1), logits.softmax(-1).bfloat16()):  # bf16: many ties
        got = router_topk.topk_indices(scores, k)
        assert torch.equal(got, router_topk.topk_indices_reference(scores, k))
    # The scores torch.topk picks, in its order (fp32 softmax scores can tie, rarely: there the
    # two may name different experts of the same score).
    scores = logits.softmax(-1)
    chosen = scores.gather(1, router_topk.topk_indices(scores, k))
    assert torch.equal(chosen, torch.topk(scores, k).values)
