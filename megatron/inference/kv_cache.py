"""The static key/value cache of incremental decoding, and the decode state beside it.

Per layer one key and one value buffer [batch, groups, capacity, head_dim] in the model's dtype
(one head per query group: GQA caches only its groups), allocated once for a batch size and a
capacity and written in place: the prefill fills slots 0..P-1 for the left-padded prompts of
length P, each decode step writes one slot. Because the prompts are left-padded, every row's
step writes the same slot, so one slot index serves the whole batch.

What a decode step reads and advances lives on the device too, so that the step is a function
of fixed shapes with no host values in it (a CUDA graph replays it, megatron.inference.decode):
  write_index [1] int64: the slot this step writes;
  positions [batch] int64: the position of the token this step feeds, per row (its count of real
      tokens so far: padding takes no position);
  key_valid [batch, capacity] bool: the slots holding a real token's key (not padding, not
      yet written), the keys a query may attend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

# Capacities are rounded up to this many slots: the memory-efficient SDPA kernel wants the
# mask's last dimension aligned, and nearby lengths share one cache (and one CUDA graph).
CAPACITY_MULTIPLE = 64


@dataclass
class KVCache:
    """Keys and values of every layer plus the decode state; see the module docstring."""

    keys: List[torch.Tensor]
    values: List[torch.Tensor]
    key_valid: torch.Tensor
    positions: torch.Tensor
    write_index: torch.Tensor

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        batch_size: int,
        num_groups: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        """Zeroed buffers: `num_layers` x keys and values [batch, groups, capacity, head_dim]."""
        shape = (batch_size, num_groups, capacity, head_dim)
        keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(
            keys=keys,
            values=values,
            key_valid=torch.zeros(batch_size, capacity, dtype=torch.bool, device=device),
            positions=torch.zeros(batch_size, dtype=torch.long, device=device),
            write_index=torch.zeros(1, dtype=torch.long, device=device),
        )

    @property
    def batch_size(self) -> int:
        """Rows of the cache."""
        return self.key_valid.shape[0]

    @property
    def capacity(self) -> int:
        """Slots per row: the longest padded prompt plus the generated tokens it can hold."""
        return self.key_valid.shape[1]

    def fits(self, batch_size: int, slots: int, dtype: torch.dtype) -> bool:
        """Whether a generation of `batch_size` rows needing `slots` slots can reuse it."""
        return (
            self.batch_size == batch_size and self.capacity >= slots and self.keys[0].dtype == dtype
        )


def round_capacity(slots: int) -> int:
    """`slots` rounded up to a multiple of CAPACITY_MULTIPLE."""
    return -(-slots // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE
