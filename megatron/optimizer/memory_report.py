"""What the distributed optimizer logs at start-up: its state's bytes on this rank, sharded
against unsharded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron.optimizer.precision import PrecisionAwareAdamW


@dataclass(frozen=True)
class OptimizerMemoryReport:
    """Optimizer-state bytes on one rank, sharded vs what `MegatronOptimizer` holds there.

    Master weights are the fp32 parameters (for the sharded optimizer, views of this rank's
    shard of them); state is the inner optimizer's per-element tensors (Adam's exp_avg and
    exp_avg_sq, SGD's momentum). Both count this rank's parameters only (its tensor-parallel
    shards, pipeline stage and experts). The grad buffers are left out: DDP holds as much.
    """

    rank: int
    data_parallel_size: int
    expert_data_parallel_size: Optional[int]  # None without expert-parallel parameters
    parameters: int
    local_parameters: int
    master_bytes_per_rank: int
    state_bytes_per_rank: int
    master_bytes_unsharded: int
    state_bytes_unsharded: int

    @property
    def bytes_per_rank(self) -> int:
        """Master-weight shard plus optimizer state on this rank."""
        return self.master_bytes_per_rank + self.state_bytes_per_rank

    @property
    def bytes_unsharded(self) -> int:
        """What the non-distributed optimizer holds on this rank."""
        return self.master_bytes_unsharded + self.state_bytes_unsharded

    def __str__(self) -> str:
        mib = 1024.0**2
        experts = (
            ""
            if self.expert_data_parallel_size is None
            else f" (experts over {self.expert_data_parallel_size} expert-data-parallel ranks)"
        )
        return (
            f"distributed optimizer: sharded over {self.data_parallel_size} data-parallel ranks"
            f"{experts}: "
            f"optimizer state {self.bytes_per_rank / mib:.2f} MiB on rank {self.rank} (master "
            f"weights {self.master_bytes_per_rank / mib:.2f} + state "
            f"{self.state_bytes_per_rank / mib:.2f}) instead of {self.bytes_unsharded / mib:.2f} "
            f"MiB, saving {(self.bytes_unsharded - self.bytes_per_rank) / mib:.2f} MiB there"
        )


def state_bytes_per_element(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of per-element state the optimizer keeps once it has stepped (on the device or,
    offloaded, on the host: the report counts both)."""
    if isinstance(optimizer, PrecisionAwareAdamW):
        return sum(torch.empty((), dtype=d).element_size() for d in optimizer.state_dtypes.values())
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 4 * (3 if optimizer.defaults.get("amsgrad") else 2)
    if isinstance(optimizer, torch.optim.SGD):
        return 4 if optimizer.defaults.get("momentum", 0.0) != 0.0 else 0
    raise ValueError(f"memory_report does not know the state of {type(optimizer).__name__}")
