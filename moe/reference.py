"""A loop-over-experts MoE: the plainest statement of what the MoE and dMoE layers compute.

Used by the tests as the ground truth and by the layers as the `reference` backend. The token
order that decides drops is MegaBlocks': assignment a = t * top_k + j (token t's j-th choice);
an expert keeps its first `capacity` assignments in increasing a, i.e. in the order of the
stable sort by expert that the permutation kernels use. With `drop_by_weight` (Megatron-Core's
`probs` policy) it keeps its `capacity` highest-weight ones, equal weights in increasing a.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

ExpertFunction = Callable[[int, torch.Tensor], torch.Tensor]


def reference_moe(
    tokens: torch.Tensor,
    expert_weights: torch.Tensor,
    expert_indices: torch.Tensor,
    expert_function: ExpertFunction,
    num_experts: int,
    capacity: Optional[int] = None,
    drop_by_weight: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """sum_j expert_weights[t, j] * expert_{indices[t, j]}(tokens[t]) over kept assignments.

    tokens [T, h], expert_weights and expert_indices [T, k]; `expert_function(e, x)` runs
    expert e on rows x [n, h]. Returns (output [T, h], tokens_per_expert int [E], counted
    before drops). Differentiable through tokens, weights and the experts.
    """
    top_k = expert_indices.shape[1]
    flat_indices = expert_indices.reshape(-1)
    flat_weights = expert_weights.reshape(-1)
    output = torch.zeros_like(tokens)
    tokens_per_expert = torch.bincount(flat_indices, minlength=num_experts)[:num_experts]
    for expert in range(num_experts):
        assignments = torch.nonzero(flat_indices == expert).squeeze(1)
        if capacity is not None:
            if drop_by_weight:
                weights = flat_weights[assignments].detach()
                assignments = assignments[torch.argsort(weights, descending=True, stable=True)]
            assignments = assignments[:capacity]
        if assignments.numel() == 0:
            continue
        token_ids = assignments // top_k
        expert_output = expert_function(expert, tokens[token_ids])
        weighted = expert_output * flat_weights[assignments].unsqueeze(1).to(expert_output.dtype)
        output = output.index_add(0, token_ids, weighted)
    return output, tokens_per_expert.int()
