"""moe.kernels.token_rows: the Triton kernels (Triton's CPU interpreter) against the references,
forward and backward, for the top-k > 1 permutation of the compiled dMoE."""

import pytest
import torch

from megatron.kernels.dispatch import TRITON_AVAILABLE
from moe.kernels import permute, token_rows, traceable

pytestmark = [
    pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed"),
    pytest.mark.usefixtures("triton_kernels"),
]


def _assignments(tokens, top_k, num_experts, seed):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, num_experts, generator=generator)
    expert_indices = scores.topk(top_k, dim=-1).indices
    order, slot_of, tokens_per_expert = traceable.sort_assignments(expert_indices, num_experts)
    return order, slot_of, torch.cumsum(tokens_per_expert, 0).int()


@pytest.mark.parametrize(
    "tokens,hidden,top_k",
    [(37, 300, 2), (21, 24, 4), (16, 64, 8)],  # rows and channels off the 16 x 256 tiles
)
def test_gather_and_sum_kernels_match_the_references(tokens, hidden, top_k):
    order, slot_of, bins = _assignments(tokens, top_k, 10, seed=hidden + top_k)
    x = torch.randn(tokens, hidden, requires_grad=True)
    y = torch.randn(tokens * top_k, hidden, requires_grad=True)
    grad_gathered = torch.randn(tokens * top_k, hidden)
    grad_summed = torch.randn(tokens, hidden)
    results = {}
    for name, gather, sum_rows in (
        ("kernels", lambda x: token_rows.gather_rows(x, order, slot_of, top_k),
         lambda y: token_rows.sum_rows(y, order, slot_of, top_k)),
        ("reference", lambda x: permute.gather_reference(x, order.int(), bins, top_k),
         lambda y: permute.scatter_reference(y, order.int(), None, bins, top_k)),
    ):  # fmt: skip
        x.grad = y.grad = None
        gathered, summed = gather(x), sum_rows(y)
        torch.autograd.backward([gathered, summed], [grad_gathered, grad_summed])
        results[name] = (gathered, summed, x.grad, y.grad)
    for got, want in zip(results["kernels"], results["reference"]):
        # Both sum the top_k rows in fp32, in different orders.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sum_kernel_rounds_bf16_rows_like_the_reference():
    tokens, hidden, top_k = 19, 40, 2
    order, slot_of, _ = _assignments(tokens, top_k, 4, seed=3)
    y = torch.randn(tokens * top_k, hidden).to(torch.bfloat16)
    got = token_rows.sum_rows(y, order, slot_of, top_k)
    want = token_rows.sum_rows_reference(y, slot_of, top_k)
    assert got.dtype == torch.bfloat16
    # fp32 sums of the same two rows, rounded once to bf16: equal up to the sum's order.
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-6)
