"""The weighted auxiliary losses of a model's MoE layers (moe.layers), collected after each
forward for the training step to add to the LM loss."""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn

from moe.layers import moe_layers


class MoEAuxiliaryLosses:
    """Collects the weighted auxiliary losses of a model's MoE layers after each forward.

    Each name the routers weight (moe.router.Router.loss_weights) gives one term: its weight
    times the mean of the layers' losses of that name. "load balancing loss":
    --moe-loss-weight (MegaBlocks' batched_load_balancing_loss when every layer is an MoE
    layer; none with --moe-router-load-balancing-type none); "router z loss" (only with
    --moe-zloss-weight > 0).

    Under pipeline parallelism each stage holds some of the layers: called with the model
    chunk that just ran, it returns that chunk's share, the weighted sum of its layers' losses
    over `num_moe_layers` (the whole model's count), so the shares add up to the terms of one
    process.
    """

    def __init__(self, model: nn.Module, num_moe_layers: Optional[int] = None) -> None:
        self.layers = [layer for _, layer in moe_layers(model)]
        self.num_moe_layers = num_moe_layers or len(self.layers)

    def __call__(self, chunk: Optional[nn.Module] = None) -> Dict[str, torch.Tensor]:
        """The losses of the latest forward of `chunk` (default: the whole model); clears
        them from its layers. {} when it holds no MoE layer."""
        layers = self.layers if chunk is None else [layer for _, layer in moe_layers(chunk)]
        if not layers:
            return {}
        if any(layer.auxiliary_losses is None for layer in layers):
            raise RuntimeError(
                "MoEAuxiliaryLosses called before every MoE layer ran a forward; call it once "
                "after each model forward"
            )
        losses = {}
        for name, weight in layers[0].router.loss_weights().items():
            # Sum over count: the shares of the stages add up to the mean over the model's
            # layers.
            total = torch.stack([layer.auxiliary_losses[name] for layer in layers]).sum()
            losses[name] = weight * (total / self.num_moe_layers)
        for layer in layers:
            layer.auxiliary_losses = None
        return losses
