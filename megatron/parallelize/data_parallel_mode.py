"""The run's data-parallel mode, chosen from its flags in this one place: `--use-torch-fsdp2`
(megatron.parallelize.fully_shard.FullyShard), `--use-distributed-optimizer`
(megatron.parallelize.data_parallel.ShardedOptimizerState) or neither (`Replicated`).
parallelize builds the run's mode here, and the memory planner asks it for the configs it
tries; no process group is needed to ask."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron.parallelize.data_parallel import DataParallel, Replicated, ShardedOptimizerState
from megatron.parallelize.fully_shard import FullyShard

if TYPE_CHECKING:
    from megatron.config import Config


def data_parallel_mode(config: Config) -> DataParallel:
    """The data-parallel mode `config` asks for."""
    if config.parallel.use_torch_fsdp2:
        return FullyShard(config)
    if config.parallel.use_distributed_optimizer:
        return ShardedOptimizerState(config)
    return Replicated(config)
