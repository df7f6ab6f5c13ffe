"""The dMoE's router for the Hugging Face modeling file (modeling_megatron_dmoe.py), in a file of
its own beside it: the routing rule of that file's docstring, as the project's moe/router.py
routes. Imports only torch and the configuration file."""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_megatron_dmoe import MegatronDMoEConfig

ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """A 16-bit tensor in fp32, else `x` as it is: the cast autocast makes for the ops it runs
    in fp32 (softmax, norm), which the project's bf16 runs route under; fp64 stays fp64."""
    return x.float() if x.element_size() < 4 else x


class Router(nn.Module):
    """The bias-free linear gate and the routing rule of modeling_megatron_dmoe.py's docstring:
    tokens [T, h] -> each token's moe_top_k experts and their weights."""

    def __init__(self, config: MegatronDMoEConfig) -> None:
        super().__init__()
        self.top_k = config.moe_top_k
        self.score = config.moe_router_score
        self.pre_softmax = config.moe_router_pre_softmax
        self.normalize_p = config.normalize_expert_weights
        self.scaling_factor = config.moe_router_topk_scaling_factor
        self.logits_dtype = ROUTER_DTYPES.get(config.moe_router_dtype)
        self.layer = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        if config.has_expert_bias:
            # A buffer, as the project's: stored under the checkpoint's key, fixed at inference.
            self.register_buffer("expert_bias", torch.zeros(config.num_experts))
        else:
            self.expert_bias = None

    def forward(self, x_TH: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, experts [T, k] int64) of tokens [T, h]."""
        return self.route(self.logits(x_TH))

    def logits(self, x_TH: torch.Tensor) -> torch.Tensor:
        """The gate's logits [T, E]."""
        if self.logits_dtype is None:
            return self.layer(x_TH)
        dtype = self.logits_dtype
        return F.linear(x_TH.to(dtype), self.layer.weight.to(dtype))

    def route(self, logits_TE: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, experts [T, k] int64) from logits [T, E], the experts in
        descending order of the score they were chosen by."""
        if self.score == "softmax":
            scores = at_least_fp32(logits_TE).softmax(dim=-1)
        else:
            scores = logits_TE.sigmoid()  # autocast leaves a sigmoid in the compute dtype
        experts = self.choose(scores)
        if self.score == "softmax" and not self.pre_softmax:
            # .float(), not at_least_fp32: the project takes this softmax in fp32 even when
            # its logits are fp64.
            weights = logits_TE.gather(1, experts).float().softmax(dim=-1)
        else:
            weights = scores.gather(1, experts)
        if self.normalize_p is not None:
            norm = torch.norm(at_least_fp32(weights), p=self.normalize_p, dim=-1, keepdim=True)
            weights = weights / norm
        if self.scaling_factor is not None:
            weights = weights * self.scaling_factor
        return weights.float(), experts

    def choose(self, scores_TE: torch.Tensor) -> torch.Tensor:
        """The top-k experts [T, k] by score, plus the expert bias in fp32 where there is one,
        as the project's router chooses them and breaks their ties."""
        if self.expert_bias is not None:
            scores_TE = scores_TE.float() + self.expert_bias.float()
        if self.top_k == 1:
            return scores_TE.argmax(dim=-1, keepdim=True)  # first maximum on ties
        # A stable descending sort keeps tied experts in index order: ties to the lower index,
        # as the project's top-k kernel (torch.topk does not promise it), which ranks in fp32.
        ranked = scores_TE.float().sort(dim=-1, descending=True, stable=True).indices
        return ranked[:, : self.top_k]
