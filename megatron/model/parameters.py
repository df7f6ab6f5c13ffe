"""Parameter counting and weight-decay grouping."""

from __future__ import annotations

from typing import Any, Dict, List

from torch import nn


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements; a tied weight counts once."""
    return sum(p.numel() for p in model.parameters())


def param_groups_for_weight_decay(model: nn.Module, weight_decay: float) -> List[Dict[str, Any]]:
    """Two optimizer groups: weight matrices and embeddings decay; biases and norm weights don't.

    Megatron's rule: no decay for names ending in ".bias" or any 1-D parameter (norm weights).
    Frozen parameters (requires_grad=False) are left out.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if name.endswith(".bias") or param.dim() == 1:
            no_decay.append(param)
        else:
            decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
