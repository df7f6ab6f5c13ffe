"""The run's data-parallel mode, built from the kind its flags ask for
(`ParallelConfig.data_parallel_kind`, decided in megatron.config.data_parallel_kind): FullyShard
(`--use-torch-fsdp2`, megatron.parallelize.fully_shard), ShardedOptimizerState
(`--use-distributed-optimizer`, megatron.parallelize.data_parallel) or Replicated. parallelize
builds the run's mode here, and the memory planner asks it for the configs it tries; no process
group is needed to ask."""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Type

from megatron.config.data_parallel_kind import DataParallelKind
from megatron.parallelize.data_parallel import DataParallel, Replicated, ShardedOptimizerState
from megatron.parallelize.fully_shard import FullyShard

if TYPE_CHECKING:
    from megatron.config import Config

MODES: Dict[DataParallelKind, Type[DataParallel]] = {
    mode.kind: mode for mode in (Replicated, ShardedOptimizerState, FullyShard)
}


def data_parallel_mode(config: Config) -> DataParallel:
    """The data-parallel mode `config` asks for."""
    return MODES[config.parallel.data_parallel_kind](config)
