"""Router: top-k selection, weight normalization, jitter, sigmoid scores, the auxiliary losses
and the DeepSeek-V3 expert bias."""

import math

import pytest
import torch

from moe.config import MoEConfig
from moe.router import (
    Router,
    balancing_probabilities,
    load_balancing_loss,
    router_z_loss,
    update_expert_bias,
)


def _router(**overrides):
    torch.manual_seed(0)
    config = MoEConfig(**{"num_experts": 4, "top_k": 2, **overrides})
    return Router(8, config, init_std=0.5)


def test_top_k_picks_the_highest_scores_and_weights_are_those_scores():
    router = _router()
    x = torch.randn(10, 8)
    routing = router(x)
    expected = torch.softmax(x @ router.layer.weight.t(), dim=-1)
    torch.testing.assert_close(routing.scores, expected)
    top_values, top_indices = expected.topk(2, dim=-1)
    assert torch.equal(routing.expert_indices, top_indices)
    torch.testing.assert_close(routing.expert_weights, top_values)


def test_normalize_expert_weights_by_p_norm():
    x = torch.randn(10, 8)
    for p in (1.0, 2.0):
        routing = _router(normalize_expert_weights=p)(x)
        norms = torch.norm(routing.expert_weights, p=p, dim=-1)
        torch.testing.assert_close(norms, torch.ones(10))


def test_jitter_only_in_training():
    router = _router(jitter_eps=0.1)
    x = torch.randn(10, 8)
    router.eval()
    first, second = router(x).logits, router(x).logits
    assert torch.equal(first, second)
    router.train()
    jittered = router(x).logits
    assert not torch.equal(jittered, first)
    # Multiplicative noise in [1 - eps, 1 + eps] on the input: logits stay close.
    assert (jittered - first).abs().max() < 0.5 * first.abs().max()


@pytest.mark.parametrize("top_k", [1, 2])
def test_forced_load_balancing_draws_experts_evenly_and_weights_them_by_the_router(top_k):
    """--moe-router-force-load-balancing: a router that prefers expert 0 for every token still
    spreads the tokens evenly, each weighted by the router's own score for its expert."""
    router = _router(num_experts=8, top_k=top_k, router_force_load_balancing=True)
    with torch.no_grad():
        router.layer.weight.zero_()
        router.layer.weight[0] = 1.0  # every positive token scores expert 0 highest
    x = torch.rand(8000, 8) + 0.1
    x.requires_grad_(True)
    routing = router(x)
    assert routing.expert_indices.shape == (8000, top_k)
    for row in routing.expert_indices:
        if top_k > 1:
            assert len(set(row.tolist())) == top_k  # distinct experts per token
        break
    counts = torch.bincount(routing.expert_indices.reshape(-1), minlength=8).double()
    assert counts.max() / counts.mean() < 1.1  # about 1000 +- 32 each
    torch.testing.assert_close(
        routing.expert_weights, routing.scores.gather(1, routing.expert_indices)
    )
    routing.expert_weights.sum().backward()
    assert router.layer.weight.grad is not None and router.layer.weight.grad.abs().sum() > 0
    assert not _router(num_experts=8, top_k=top_k).config.router_force_load_balancing


def test_sigmoid_router():
    router = _router(router_score="sigmoid", normalize_expert_weights=1.0)
    x = torch.randn(10, 8)
    routing = router(x)
    torch.testing.assert_close(routing.scores, torch.sigmoid(x @ router.layer.weight.t()))
    torch.testing.assert_close(routing.expert_weights.sum(-1), torch.ones(10))
    probabilities = balancing_probabilities(routing, "sigmoid")
    torch.testing.assert_close(probabilities.sum(-1), torch.ones(10))


def test_load_balancing_loss_hand_checked():
    # 2 tokens, 2 experts, top-1: token 0 -> expert 0, token 1 -> expert 0.
    scores = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    tokens_per_expert = torch.tensor([2, 0])
    # E / (T k) * sum_e count_e * mean_t p_te = 2 / 2 * (2 * 0.625 + 0 * 0.375) = 1.25
    assert load_balancing_loss(tokens_per_expert, scores, top_k=1).item() == pytest.approx(1.25)
    # Perfect balance gives 1.
    uniform = torch.full((4, 4), 0.25)
    assert load_balancing_loss(torch.tensor([2, 2, 2, 2]), uniform, top_k=2).item() == (
        pytest.approx(1.0)
    )


def test_load_balancing_loss_gradient_flows_to_scores_only():
    scores = torch.tensor([[0.75, 0.25], [0.5, 0.5]], requires_grad=True)
    load_balancing_loss(torch.tensor([2, 0]), scores, top_k=1).backward()
    # d/dp_te = E / (T k) * count_e / T = 1 / 2 * [2, 0]
    torch.testing.assert_close(scores.grad, torch.tensor([[1.0, 0.0], [1.0, 0.0]]))


def test_router_z_loss_hand_checked():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    expected = (math.log(2.0) ** 2 + math.log(4.0) ** 2) / 2
    assert router_z_loss(logits).item() == pytest.approx(expected)


def test_expert_bias_selects_but_does_not_weight():
    router = _router(router_bias_update_rate=0.1, top_k=1)
    x = torch.randn(10, 8)
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    routing = router(x)
    assert torch.all(routing.expert_indices == 3)
    torch.testing.assert_close(routing.expert_weights.squeeze(1), routing.scores[:, 3])


@pytest.mark.parametrize("top_k, chosen", [(1, [1]), (2, [1, 3])])
def test_the_expert_bias_decides_in_fp32_where_bf16_scores_would_round_it_away(top_k, chosen):
    """bf16 sigmoid scores of 0.5 lie 2^-8 apart: a bias of 1e-3 added in bf16 is lost and
    every expert ties; in fp32 (Megatron-Core's promotion) it picks."""
    router = _router(router_bias_update_rate=1e-3, top_k=top_k, router_score="sigmoid")
    router.expert_bias.copy_(torch.tensor([0.0, 1.5e-3, 0.0, 1e-3]))
    routing = router.route(torch.zeros(3, 4, dtype=torch.bfloat16))  # every score 0.5
    assert routing.expert_indices.tolist() == [chosen] * 3
    assert torch.all(routing.expert_weights == 0.5)  # the bias picks, it does not weight


def test_update_expert_bias_moves_toward_balance():
    bias = torch.zeros(4)
    update_expert_bias(bias, torch.tensor([10, 2, 2, 2]), rate=0.01)
    torch.testing.assert_close(bias, torch.tensor([-0.01, 0.01, 0.01, 0.01]))
