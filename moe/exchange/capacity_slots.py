"""The capacity-limited MoE's (`--no-moe-dropless`) exchange: fixed-size capacity slots.

As MegaBlocks runs it, each rank fills the capacity slots of all E experts with its own tokens,
exactly as one process fills them for its micro-batch (the same assignments dropped), and sends
each expert's block of slots to the expert's rank in one all-to-all of equal splits; the experts
run on every rank's slots and the outputs come back the same way. The slots have a fixed size:
no counts to exchange, no host sync.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from moe.exchange.primitives import all_to_all


def run_capacity_slots(
    slots: torch.Tensor,
    size: int,
    group: Optional[dist.ProcessGroup],
    forward_batched: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The capacity-limited MoE's experts split over `size` ranks: this rank's capacity slots
    of all E experts [E, C, h] go to the experts' ranks in one all-to-all of equal splits (rank
    p's experts are the p-th block of E / P), `forward_batched` runs the local experts on the
    slots of every rank, and the outputs come back the same way."""
    num_experts, capacity, hidden = slots.shape
    local = num_experts // size
    splits = [local * capacity] * size
    received = all_to_all(slots.reshape(-1, hidden), splits, splits, group)
    # [source, local expert, C, h] -> [local expert, source * C, h]
    by_expert = received.view(size, local, capacity, hidden).transpose(0, 1)
    outputs = forward_batched(by_expert.reshape(local, size * capacity, hidden))
    outputs = outputs.view(local, size, capacity, hidden).transpose(0, 1).reshape(-1, hidden)
    returned = all_to_all(outputs, splits, splits, group)
    return returned.view(num_experts, capacity, hidden)
