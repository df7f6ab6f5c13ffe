"""MoE layers under tensor parallelism: where the layer enters and leaves the TP region.

As in Megatron-core by default (expert tensor parallel size = TP size), every TP rank holds all
experts (or its expert-parallel block of them) with f / tp of each expert's ffn channels
(moe.experts), so its experts turn the whole token set into a partial output P_r, and the
layer's output is sum_r sum_k w_k P_r,k. The router is replicated and routes the whole token set,
so routing, load-balancing loss and z-loss are the single-process numbers on every TP rank.

Gradients, rank r, the layer's output gradient dy being complete and replicated:
- combine weights w [T, k]: rank r sees only <dy, P_r,k>, its share of dL/dw. They enter the
  experts through `copy_to_tensor_model_parallel_region` (identity forward, all-reduce
  backward): T x k numbers, after which dL/dw and everything upstream of it (scores, logits,
  router weight, the router's input gradient) are complete on every rank;
- the experts' input: each rank's gradient is partial (its channels only), so it enters through
  copy_to_... as well (all-reduce backward), while the router's input does not: its gradient is
  already complete, and an all-reduce would count it tp times;
- the partial outputs are summed by `reduce_from_tensor_model_parallel_region` (all-reduce
  forward, identity backward); an output bias is added once, after the sum.

With sequence parallelism the layer gets this rank's sequence shard [b, s / tp, h]. The router
gates the shard and the logits [b, s / tp, E] are all-gathered with a backward that only splits
(its rows' gradient is complete on every rank): cheaper than gathering the hidden states for it,
and the router's jitter is drawn on the shard (from the block's random source, the rank's stream
when the model has dropout: not the single-process noise, as for dropout; every rank still
routes the same gathered logits). Each rank's
router weight gradient then covers its own tokens only: the weight is marked
`sequence_parallel`, so `megatron.parallelize.gradient_sync.GradientSync.after_backwards` sums it over the
TP group once per step (as for the norms; the router is not all-reduced anywhere else, so nothing is counted
twice). The experts' input is all-gathered with a reduce-scatter backward, and the partial
output is reduce-scattered back to the sequence shard; the output bias, added to the shard
only, is marked `sequence_parallel` too.
"""

from __future__ import annotations

import dataclasses
from typing import Tuple

import torch
from torch import nn

from megatron.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    set_sequence_parallel_attribute,
)
from moe.router import Router, Routing


class TensorParallelRegion(nn.Module):
    """Where an MoE layer's tokens enter its experts and their output leaves, over the
    tensor-parallel group (the module docstring): the parallel form of moe.router.LocalRegion,
    swapped in by `moe_layer_style`. No parameters."""

    def __init__(self, sequence_parallel: bool) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def enter(
        self, router: Router, tokens: torch.Tensor, shape: torch.Size
    ) -> Tuple[Routing, torch.Tensor]:
        """(routing of the whole token set, the experts' input rows [T, h]) for this rank's
        `tokens` [N, h], which are `shape` [b, s, h] ([b, s / tp, h] with sequence
        parallelism)."""
        if self.sequence_parallel:
            local_logits = router.logits(tokens).view(*shape[:-1], -1)
            logits = gather_from_sequence_parallel_region(
                local_logits, tensor_parallel_output_grad=False
            )
            routing = router.route(logits.reshape(-1, logits.shape[-1]))
            expert_tokens = gather_from_sequence_parallel_region(tokens.view(shape))
            expert_tokens = expert_tokens.reshape(-1, shape[-1])
        else:
            routing = router(tokens)
            expert_tokens = copy_to_tensor_model_parallel_region(tokens)
        weights = copy_to_tensor_model_parallel_region(routing.expert_weights)
        return dataclasses.replace(routing, expert_weights=weights), expert_tokens

    def leave(self, partial: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The layer's expert output, shaped like its input `shape`, from this rank's partial
        output [T, h] over the whole token set."""
        if self.sequence_parallel:
            batch, _, hidden = shape
            return reduce_scatter_to_sequence_parallel_region(partial.view(batch, -1, hidden))
        return reduce_from_tensor_model_parallel_region(partial).view(shape)

    def extra_repr(self) -> str:
        return f"sequence_parallel={self.sequence_parallel}"


def moe_layer_style(layer: nn.Module, layout) -> None:
    """Tensor-parallel style of an MoE layer (megatron.parallelize.tensor_parallelism): its tokens
    enter and leave through `TensorParallelRegion`; under sequence parallelism the router
    weight and the output bias see one sequence shard per rank, so their gradients are summed
    over the TP group after backward. The experts split their channels by their own style; the
    shared expert is a dense MLP."""
    layer.region = TensorParallelRegion(layout.sequence_parallel)
    if layout.sequence_parallel:
        set_sequence_parallel_attribute(layer.router.layer.weight)
        if layer.bias is not None:
            set_sequence_parallel_attribute(layer.bias)


def experts_style(experts: nn.Module, layout) -> None:
    """Tensor-parallel style of the experts: each rank keeps its share of every expert's ffn
    channels (moe.experts.Experts.keep_ffn_channels)."""
    experts.keep_ffn_channels(layout.size, layout.rank)
