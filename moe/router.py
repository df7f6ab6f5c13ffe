"""Learned top-k router (MegaBlocks' `LearnedRouter`), its auxiliary losses, and the
DeepSeek-V3 auxiliary-loss-free expert bias."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from moe.config import MoEConfig
from moe.kernels import router_topk


@dataclass
class Routing:
    """One layer's routing of T tokens to k of E experts.

    logits [T, E] and scores [T, E] (softmax or sigmoid of logits); expert_weights [T, k],
    differentiable; expert_indices [T, k], int64, the chosen experts in descending score order.
    """

    logits: torch.Tensor
    scores: torch.Tensor
    expert_weights: torch.Tensor
    expert_indices: torch.Tensor


class Router(nn.Module):
    """h -> E logits (linear, no bias) -> scores -> top-k experts and their weights.

    In training with `jitter_eps`, the router's input (not the experts') is multiplied by
    U(1 - eps, 1 + eps) noise, as MegaBlocks does. With `router_bias_update_rate` > 0 the
    buffer `expert_bias` is added to the scores to pick experts but not to weight them. With
    `router_force_load_balancing` (benchmarks) the experts are drawn uniformly at random.
    """

    def __init__(self, hidden_size: int, config: MoEConfig, init_std: float = 0.02) -> None:
        super().__init__()
        self.config = config
        self.layer = nn.Linear(hidden_size, config.num_experts, bias=False)
        nn.init.normal_(self.layer.weight, mean=0.0, std=init_std)
        if config.router_bias_update_rate > 0:
            # A buffer: moved by update_expert_bias, outside autograd, and checkpointed.
            self.register_buffer("expert_bias", torch.zeros(config.num_experts))
        else:
            self.expert_bias = None

    @torch.no_grad()
    def init_own_weights(self, std: float, output_std: float) -> None:
        """The expert bias starts at zero (the linear layer is initialized as a submodule)."""
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    def jitter(self, x: torch.Tensor) -> torch.Tensor:
        """Multiplicative U(1 - eps, 1 + eps) noise shaped like `x`."""
        eps = self.config.jitter_eps
        noise = torch.rand(x.shape, dtype=x.dtype, device=x.device)
        return (1.0 - eps) + noise * (2.0 * eps)

    def forward(self, x: torch.Tensor) -> Routing:
        """Route tokens x [T, h]."""
        return self.route(self.logits(x))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The gate's logits [T, E] for tokens x [T, h] (jittered in training)."""
        if self.training and self.config.jitter_eps is not None:
            x = x * self.jitter(x)
        return self.layer(x)

    def route(self, logits: torch.Tensor) -> Routing:
        """Scores, top-k experts and their weights from logits [T, E]; split from `logits` so
        that a sequence-parallel layer can gate its shard and route the gathered logits."""
        config = self.config
        if config.router_score == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
        selection_scores = scores
        if self.expert_bias is not None:
            selection_scores = scores.detach() + self.expert_bias.to(scores.dtype)
        if config.router_force_load_balancing:
            # Benchmarks: a uniformly random first expert and the k - 1 after it balance every
            # expert (and expert-parallel rank) up to sampling noise, at the cost of one small
            # kernel; the weights still come from the router, so it keeps its gradient and the
            # layer its work.
            first = torch.randint(config.num_experts, (scores.shape[0], 1), device=scores.device)
            steps = torch.arange(config.top_k, device=scores.device)
            expert_indices = (first + steps) % config.num_experts
        elif config.top_k == 1 and self.expert_bias is None:
            # A plain reduction, where torch.topk's selection kernel costs a noticeable share of
            # a dMoE 125M training step (docs/benchmark-log.md). Not with the expert bias:
            # equally biased experts tie often there, and argmax breaks ties toward the lowest
            # index where topk does not, which changes the balancing.
            expert_indices = selection_scores.argmax(dim=-1, keepdim=True)
        elif self.expert_bias is None:
            # One pass over the scores where torch.topk runs a selection and a sort
            # (docs/benchmark-log.md); ties go to the lower index, as argmax's.
            expert_indices = router_topk.topk_indices(selection_scores, config.top_k)
        else:
            _, expert_indices = torch.topk(selection_scores, config.top_k, dim=-1)
        expert_weights = scores.gather(1, expert_indices)
        if config.normalize_expert_weights is not None:
            expert_weights = expert_weights / torch.norm(
                expert_weights, p=config.normalize_expert_weights, dim=-1, keepdim=True
            )
        return Routing(logits, scores, expert_weights, expert_indices)


def load_balancing_loss(
    tokens_per_expert: torch.Tensor, scores: torch.Tensor, top_k: int
) -> torch.Tensor:
    """Switch/MegaBlocks load-balancing loss of one layer, unweighted (1.0 when balanced).

    E / (T * k) * sum_e tokens_per_expert[e] * mean_t scores[t, e], with tokens_per_expert
    counting all T * k assignments (before any capacity drop). MegaBlocks'
    `batched_load_balancing_loss` is this averaged over layers and times --moe-loss-weight.
    `scores` [T, E] are per-token probabilities (see `balancing_probabilities`).
    """
    num_tokens, num_experts = scores.shape
    scores = scores.float()
    if num_tokens == 0:
        return scores.sum() * 0.0
    mean_scores = scores.mean(dim=0)
    scale = num_experts / (num_tokens * top_k)
    return scale * torch.dot(tokens_per_expert.to(mean_scores.dtype), mean_scores)


def balancing_probabilities(routing: Routing, router_score: str) -> torch.Tensor:
    """The [T, E] probabilities the load-balancing loss uses: softmax scores as they are,
    sigmoid scores normalized to sum to 1 per token (as DeepSeek-V3's balance loss does)."""
    if router_score == "softmax":
        return routing.scores
    return routing.scores / routing.scores.sum(dim=-1, keepdim=True)


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss of one layer, unweighted: mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


@torch.no_grad()
def update_expert_bias(
    expert_bias: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    rate: float,
    group: Optional[dist.ProcessGroup] = None,
) -> None:
    """DeepSeek-V3's update: bias += rate * sign(mean load - load), in place.

    Overloaded experts become less likely to be picked, underloaded ones more. Counts are
    summed over `group` (default: all ranks, when torch.distributed is initialized) so that
    every data-parallel replica keeps the same bias.
    """
    counts = tokens_per_expert.to(device=expert_bias.device, dtype=torch.float32)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        counts = counts.clone()
        dist.all_reduce(counts, group=group)
    expert_bias += rate * torch.sign(counts.mean() - counts).to(expert_bias.dtype)


class LocalRegion(nn.Module):
    """Where an MoE layer's tokens enter its experts and their output leaves, on one rank: the
    router routes the tokens themselves, and the output takes their shape. Tensor parallelism
    swaps it for moe.tensor_parallel.TensorParallelRegion. No parameters."""

    def enter(
        self, router: Router, tokens: torch.Tensor, shape: torch.Size
    ) -> Tuple[Routing, torch.Tensor]:
        """(routing of `tokens` [T, h], the experts' input rows: `tokens`)."""
        return router(tokens), tokens

    def leave(self, output: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The experts' output [T, h] shaped like the layer's input `shape`."""
        return output.view(shape)
