"""Learned top-k router (MegaBlocks' `LearnedRouter`), its auxiliary losses, and the
DeepSeek-V3 auxiliary-loss-free expert bias.

The router owns its losses: `Router.auxiliary_losses` returns them by name, unweighted, and
`Router.loss_weights` says which a run adds to the LM loss and with what weight, so that a new
loss is one entry here (moe.auxiliary_losses sums each name over the layers; the log, TensorBoard
and W&B take the names as they come).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional
from torch import nn

from megatron.parallel import parallel_state
from moe.config import ROUTER_DTYPES, MoEConfig
from moe.kernels import router_topk

LOAD_BALANCING_LOSS = "load balancing loss"
ROUTER_Z_LOSS = "router z loss"


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

    The weights: each chosen expert's softmax score over all experts (`router_pre_softmax`,
    MegaBlocks' and Switch's rule) or the softmax over the k chosen logits alone (Megatron-Core's
    default, Mixtral's), or the sigmoid scores; then normalized (`normalize_expert_weights`) and
    scaled (`router_topk_scaling_factor`).
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
        if config.load_balancing_type == "global_aux_loss":
            # The assignments per expert, then the tokens, summed over the data-parallel ranks
            # and the training micro-batches of the step so far; cleared before each step's
            # forwards (moe.training_hooks), so not checkpointed.
            self.register_buffer(
                "step_assignments", torch.zeros(config.num_experts + 1), persistent=False
            )
        else:
            self.step_assignments = None

    @torch.no_grad()
    def init_own_weights(self, std: float, output_std: float) -> None:
        """The expert bias and the step's counts start at zero (the linear layer is initialized
        as a submodule)."""
        for buffer in (self.expert_bias, self.step_assignments):
            if buffer is not None:
                buffer.zero_()

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
        if self.config.router_dtype is None:
            return self.layer(x)
        dtype = ROUTER_DTYPES[self.config.router_dtype]
        with torch.autocast(x.device.type, enabled=False):
            return nn.functional.linear(x.to(dtype), self.layer.weight.to(dtype))

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
            # In fp32, as Megatron-Core's type promotion of bf16 scores and the fp32 bias gives:
            # bf16 sigmoid scores near 0.5 lie 2^-8 apart, and would round a bias step of 1e-3
            # away.
            selection_scores = scores.detach().float() + self.expert_bias.float()
        if config.router_force_load_balancing:
            # Benchmarks: a uniformly random first expert and the k - 1 after it balance every
            # expert (and expert-parallel rank) up to sampling noise, at the cost of one small
            # kernel; the weights still come from the router, so it keeps its gradient and the
            # layer its work.
            first = torch.randint(config.num_experts, (scores.shape[0], 1), device=scores.device)
            steps = torch.arange(config.top_k, device=scores.device)
            expert_indices = (first + steps) % config.num_experts
        elif config.top_k == 1:
            # A plain reduction, where torch.topk's selection kernel costs a noticeable share of
            # a dMoE 125M training step (docs/benchmark-log.md); ties to the lower index.
            expert_indices = selection_scores.argmax(dim=-1, keepdim=True)
        else:
            # One pass over the scores where torch.topk runs a selection and a sort
            # (docs/benchmark-log.md); ties to the lower index, as argmax's.
            expert_indices = router_topk.topk_indices(selection_scores, config.top_k)
        if config.router_score == "softmax" and not config.router_pre_softmax:
            # The chosen experts' logits alone, softmaxed: the same top-k (softmax keeps the
            # order), weights that sum to 1; in fp32 as autocast computes a softmax.
            expert_weights = logits.gather(1, expert_indices).float().softmax(dim=-1)
        else:
            expert_weights = scores.gather(1, expert_indices)
        if config.normalize_expert_weights is not None:
            expert_weights = expert_weights / torch.norm(
                expert_weights, p=config.normalize_expert_weights, dim=-1, keepdim=True
            )
        if config.router_topk_scaling_factor is not None:
            expert_weights = expert_weights * config.router_topk_scaling_factor
        return Routing(logits, scores, expert_weights, expert_indices)

    def loss_weights(self) -> Dict[str, float]:
        """The auxiliary losses this router's layer adds to the LM loss, by name, and the
        weight of each one's mean over the MoE layers (MegaBlocks' rule)."""
        return auxiliary_loss_weights(self.config)

    def auxiliary_losses(
        self,
        routing: Routing,
        tokens_per_expert: torch.Tensor,
        sequences: int,
        counting: bool,
    ) -> Dict[str, torch.Tensor]:
        """This layer's unweighted losses (the names of `loss_weights`) for `routing` of
        `sequences` whole sequences of tokens, `tokens_per_expert` its assignments [E].
        `counting`: a training forward seen for the first time (not its recomputation in
        backward), whose counts join the step's under --moe-router-load-balancing-type
        global_aux_loss."""
        config = self.config
        losses = {}
        balancing = config.load_balancing_type
        if balancing != "none":
            probabilities = balancing_probabilities(routing, config.router_score)
            if balancing == "seq_aux_loss":
                loss = sequence_load_balancing_loss(
                    routing.expert_indices, probabilities, sequences
                )
            elif balancing == "global_aux_loss" and self.training:
                loss = self._step_load_balancing_loss(tokens_per_expert, probabilities, counting)
            else:
                loss = load_balancing_loss(tokens_per_expert, probabilities, config.top_k)
            losses[LOAD_BALANCING_LOSS] = loss
        if config.zloss_weight > 0:
            losses[ROUTER_Z_LOSS] = router_z_loss(routing.logits)
        return losses

    def _step_load_balancing_loss(
        self, tokens_per_expert: torch.Tensor, probabilities: torch.Tensor, counting: bool
    ) -> torch.Tensor:
        """The load-balancing loss with each expert's share of the assignments counted over
        the step's micro-batches so far on every data-parallel rank (Megatron-Core's
        global_aux_loss; Qwen's global-batch balancing): a micro-batch may favour some
        experts as long as the batch spreads its tokens. A recomputation in backward uses the
        counts as they are, which are this micro-batch's own unless another ran in between."""
        assignments = tokens_per_expert.detach().float()
        tokens = assignments.new_full((1,), probabilities.shape[0])
        counts = torch.cat([assignments, tokens])
        if dist.is_initialized() and parallel_state.model_parallel_is_initialized():
            group = parallel_state.get_data_parallel_group()
            if dist.get_world_size(group) > 1:
                # Functional: traceable, so a compiled layer keeps its one graph.
                counts = functional.all_reduce(counts, "sum", group)
        if counting:
            with torch.no_grad():
                self.step_assignments += counts
        # A copy: the loss's backward keeps it, and the next micro-batch adds to the buffer
        # in place, perhaps before this one's backward (pipeline schedules).
        window = self.step_assignments.clone()
        return load_balancing_loss(
            window[:-1], probabilities, self.config.top_k, counted_tokens=window[-1]
        )


def load_balancing_loss(
    tokens_per_expert: torch.Tensor,
    scores: torch.Tensor,
    top_k: int,
    counted_tokens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Switch/MegaBlocks load-balancing loss of one layer, unweighted (1.0 when balanced).

    E / (T * k) * sum_e tokens_per_expert[e] * mean_t scores[t, e], with tokens_per_expert
    counting all T * k assignments (before any capacity drop). MegaBlocks'
    `batched_load_balancing_loss` is this averaged over layers and times --moe-loss-weight.
    `scores` [T, E] are per-token probabilities (see `balancing_probabilities`). The counts may
    come from more tokens than `scores` holds (the step's, under global_aux_loss): then
    `counted_tokens` says how many, the T of the counts' share.
    """
    num_tokens, num_experts = scores.shape
    scores = scores.float()
    if num_tokens == 0:
        return scores.sum() * 0.0
    mean_scores = scores.mean(dim=0)
    counted = num_tokens if counted_tokens is None else counted_tokens
    scale = num_experts / (counted * top_k)
    return scale * torch.dot(tokens_per_expert.to(mean_scores.dtype), mean_scores)


def sequence_load_balancing_loss(
    expert_indices: torch.Tensor, scores: torch.Tensor, sequences: int
) -> torch.Tensor:
    """The load-balancing loss of each sequence alone, averaged over the `sequences` sequences
    the T tokens form in order (DeepSeek-V2's sequence-wise balance loss; Megatron-Core's
    seq_aux_loss): 1.0 when each sequence spreads its tokens evenly.
    expert_indices [T, k], scores [T, E] (see `balancing_probabilities`)."""
    num_tokens, num_experts = scores.shape
    top_k = expert_indices.shape[1]
    scores = scores.float()
    if num_tokens == 0:
        return scores.sum() * 0.0
    per_sequence = expert_indices.reshape(sequences, -1)
    counts = torch.zeros(sequences, num_experts, device=scores.device, dtype=scores.dtype)
    counts.scatter_add_(1, per_sequence, torch.ones_like(per_sequence, dtype=scores.dtype))
    mean_scores = scores.view(sequences, -1, num_experts).mean(dim=1)
    scale = num_experts / ((num_tokens // sequences) * top_k)
    return scale * (counts * mean_scores).sum(dim=-1).mean()


def balancing_probabilities(routing: Routing, router_score: str) -> torch.Tensor:
    """The [T, E] probabilities the load-balancing loss uses: softmax scores as they are,
    sigmoid scores normalized to sum to 1 per token (as DeepSeek-V3's balance loss does)."""
    if router_score == "softmax":
        return routing.scores
    return routing.scores / routing.scores.sum(dim=-1, keepdim=True)


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss of one layer, unweighted: mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def auxiliary_loss_weights(config: MoEConfig) -> Dict[str, float]:
    """The auxiliary losses the routers of `config` add to the LM loss, by name, and the weight
    of each one's mean over the MoE layers."""
    weights = {}
    if config.load_balancing_type != "none":
        weights[LOAD_BALANCING_LOSS] = config.loss_weight
    if config.zloss_weight > 0:
        weights[ROUTER_Z_LOSS] = config.zloss_weight
    return weights


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
