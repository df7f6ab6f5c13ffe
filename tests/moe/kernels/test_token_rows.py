"""moe.kernels.token_rows, the dMoE's rows into expert order and back: the sort and the ops
against plain-PyTorch definitions, and the Triton kernels (Triton's CPU interpreter) against
them, forward and backward."""

import pytest
import torch

from megatron.kernels.dispatch import TRITON_AVAILABLE
from moe.kernels import token_rows


def _expert_indices(tokens, top_k, num_experts, seed):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, num_experts, generator=generator)
    return scores.topk(top_k, dim=-1).indices


def _assignments(tokens, top_k, num_experts, seed):
    expert_indices = _expert_indices(tokens, top_k, num_experts, seed)
    order, slot_of, _ = token_rows.sort_assignments(expert_indices, num_experts)
    return order, slot_of


def _gather_definition(x, order, top_k):
    return x[order // top_k]


def _sum_definition(rows, slot_of, top_k):
    return rows[slot_of].view(-1, top_k, rows.shape[-1]).sum(1)


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_sort_assignments_is_the_stable_sort_by_expert(top_k):
    expert_indices = _expert_indices(37, top_k, 6, seed=top_k)
    order, slot_of, tokens_per_expert = token_rows.sort_assignments(expert_indices, 6)
    flat = expert_indices.reshape(-1)
    # Stable: ties keep assignment order, so this Python sort is the definition.
    assert order.tolist() == sorted(range(flat.numel()), key=lambda a: (int(flat[a]), a))
    assert torch.equal(slot_of[order], torch.arange(flat.numel()))
    assert tokens_per_expert.dtype == torch.int32
    assert tokens_per_expert.tolist() == torch.bincount(flat, minlength=6).tolist()


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_gather_and_sum_match_their_definitions_with_gradients(top_k):
    tokens, hidden = 29, 8
    order, slot_of = _assignments(tokens, top_k, 5, seed=top_k)
    x = torch.randn(tokens, hidden, dtype=torch.float64, requires_grad=True)
    y = torch.randn(tokens * top_k, hidden, dtype=torch.float64, requires_grad=True)
    results = []
    for gather, sum_rows in (
        (lambda x: token_rows.gather_rows(x, order, slot_of, top_k),
         lambda y: token_rows.sum_rows(y, order, slot_of, top_k)),
        (lambda x: _gather_definition(x, order, top_k),
         lambda y: _sum_definition(y, slot_of, top_k)),
    ):  # fmt: skip
        x.grad = y.grad = None
        gathered, summed = gather(x), sum_rows(y)
        (gathered.sin().sum() + summed.cos().sum()).backward()
        results.append((gathered, summed, x.grad, y.grad))
    for got, want in zip(*results):
        # The ops sum the top_k rows in fp32, the definitions in fp64.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed")
@pytest.mark.parametrize(
    "tokens,hidden,top_k",
    [(37, 300, 2), (21, 24, 4), (16, 64, 8)],  # rows and channels off the 16 x 256 tiles
)
def test_gather_and_sum_kernels_match_the_references(tokens, hidden, top_k):
    order, slot_of = _assignments(tokens, top_k, 10, seed=hidden + top_k)
    x = torch.randn(tokens, hidden, requires_grad=True)
    y = torch.randn(tokens * top_k, hidden, requires_grad=True)
    grad_gathered = torch.randn(tokens * top_k, hidden)
    grad_summed = torch.randn(tokens, hidden)
    results = {}
    for name, gather, sum_rows in (
        ("kernels", lambda x: token_rows.gather_rows(x, order, slot_of, top_k),
         lambda y: token_rows.sum_rows(y, order, slot_of, top_k)),
        ("reference", lambda x: _gather_definition(x, order, top_k),
         lambda y: _sum_definition(y, slot_of, top_k)),
    ):  # fmt: skip
        x.grad = y.grad = None
        gathered, summed = gather(x), sum_rows(y)
        torch.autograd.backward([gathered, summed], [grad_gathered, grad_summed])
        results[name] = (gathered, summed, x.grad, y.grad)
    for got, want in zip(results["kernels"], results["reference"]):
        # Both sum the top_k rows in fp32, in different orders.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed")
def test_sum_kernel_rounds_bf16_rows_like_the_reference():
    tokens, hidden, top_k = 19, 40, 2
    order, slot_of = _assignments(tokens, top_k, 4, seed=3)
    y = torch.randn(tokens * top_k, hidden).to(torch.bfloat16)
    got = token_rows.sum_rows(y, order, slot_of, top_k)
    want = token_rows.sum_rows_reference(y, slot_of, top_k)
    assert got.dtype == torch.bfloat16
    # fp32 sums of the same two rows, rounded once to bf16: equal up to the sum's order.
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-6)


def _permuted_with_padding(seed: int):
    """A permutation of 23 rows whose first 15 in the permuted order are real."""
    generator = torch.Generator().manual_seed(seed)
    index = torch.randperm(23, generator=generator)
    return index, token_rows.inverse_permutation(index), torch.tensor([15], dtype=torch.int32)


@pytest.mark.parametrize("by_source", [False, True])
def test_permute_rows_is_the_permutation_on_the_rows_that_count(by_source):
    index, inverse, valid = _permuted_with_padding(1)
    x = torch.randn(23, 12, requires_grad=True)
    out = token_rows.permute_rows(x, index, inverse, valid, by_source)
    counted = (index if by_source else torch.arange(23)) < 15
    torch.testing.assert_close(out[counted], x.detach()[index][counted], rtol=0, atol=0)
    grad = torch.randn(23, 12)
    out.backward(grad)
    # Only the counted rows' gradients reach x: each at the row it was read from.
    want = torch.zeros(23, 12).index_add_(0, index[counted], grad[counted])
    read = torch.zeros(23, dtype=torch.bool).index_fill_(0, index[counted], True)
    torch.testing.assert_close(x.grad[read], want[read], rtol=0, atol=0)


@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed")
@pytest.mark.parametrize("by_source", [False, True])
def test_permute_rows_kernel_never_writes_the_rows_that_do_not_count(by_source):
    index, inverse, valid = _permuted_with_padding(2)
    x = torch.randn(23, 300)
    out = torch.full((23, 300), float("nan"))
    token_rows.permute_rows_triton(x, index, valid, by_source, out=out)
    counted = (index if by_source else torch.arange(23)) < 15
    torch.testing.assert_close(out[counted], x[index][counted], rtol=0, atol=0)
    assert torch.isnan(out[~counted]).all()
    # The op's backward is the inverse permutation under the mirrored test.
    x.requires_grad_()
    token_rows.permute_rows(x, index, inverse, valid, by_source).backward(torch.ones(23, 300))
    read = torch.zeros(23, dtype=torch.bool).index_fill_(0, index[counted], True)
    assert torch.equal(x.grad[read], torch.ones(int(read.sum()), 300))
