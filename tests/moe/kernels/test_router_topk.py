"""moe.kernels.router_topk: the Triton kernel (Triton's CPU interpreter) against its reference,
and the reference against torch.topk."""

import pytest
import torch

from megatron.kernels.dispatch import TRITON_AVAILABLE
from moe.kernels import router_topk

needs_triton = pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed")


def _scores(tokens, experts, dtype, seed, ties=False):
    generator = torch.Generator().manual_seed(seed)
    if ties:  # four distinct values: most rows have ties inside their top k
        return (torch.randint(0, 4, (tokens, experts), generator=generator) / 4).to(dtype)
    return torch.rand(tokens, experts, generator=generator).softmax(-1).to(dtype)


@needs_triton
@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.parametrize(
    "tokens,experts,k",
    [(37, 64, 8), (5, 10, 3), (64, 8, 2), (33, 128, 4), (40, 6, 6)],  # off the 32-token tile
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_kernel_matches_reference(tokens, experts, k, dtype, ties):
    scores = _scores(tokens, experts, dtype, seed=tokens + k, ties=ties)
    got = router_topk.topk_indices(scores, k)
    want = router_topk.topk_indices_reference(scores, k)
    assert got.dtype == torch.int64 and got.shape == (tokens, k)
    assert torch.equal(got, want)


@needs_triton
@pytest.mark.usefixtures("triton_kernels")
def test_kernel_ranks_nan_first_and_never_repeats_an_expert():
    scores = torch.full((3, 6), float("-inf"))
    scores[0, 4] = float("nan")
    scores[1, 2] = 0.5
    got = router_topk.topk_indices(scores, 4)
    assert got.tolist() == [[4, 0, 1, 2], [2, 0, 1, 3], [0, 1, 2, 3]]
    assert torch.equal(got, router_topk.topk_indices_reference(scores, 4))


def test_reference_agrees_with_torch_topk_without_ties():
    scores = _scores(100, 64, torch.float32, seed=0)
    assert torch.equal(
        router_topk.topk_indices_reference(scores, 8), torch.topk(scores, 8, dim=-1).indices
    )


def test_refuses_k_out_of_range():
    with pytest.raises(ValueError, match="1 <= k <= experts"):
        router_topk.topk_indices(torch.rand(4, 8), 9)
