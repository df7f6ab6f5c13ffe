"""Which data-parallel mode a run's flags ask for: `--use-torch-fsdp2`, else
`--use-distributed-optimizer`, else neither. Decided here, in the config, so that the run's
Numerics can take the mode's answer to whether the weights are held in the compute dtype;
megatron.parallelize.data_parallel_mode builds the mode of each kind."""

from __future__ import annotations

import enum


class DataParallelKind(enum.Enum):
    REPLICATED = "replicated"  # torch DDP, one all-reduce, or one replica
    SHARDED_OPTIMIZER_STATE = "sharded optimizer state"  # the distributed optimizer, ZeRO-1
    FULLY_SHARD = "fully shard"  # torch's FSDP2

    @classmethod
    def of(cls, use_torch_fsdp2: bool, use_distributed_optimizer: bool) -> DataParallelKind:
        if use_torch_fsdp2:
            return cls.FULLY_SHARD
        if use_distributed_optimizer:
            return cls.SHARDED_OPTIMIZER_STATE
        return cls.REPLICATED

    @property
    def holds_weights_in_compute_dtype(self) -> bool:
        """Whether the mode keeps the weights autocast would cast in the compute dtype under
        --bf16/--fp16, with fp32 master weights beside them: the distributed optimizer gathers
        them in it, FSDP2 in its mixed-precision policy; replicas keep fp32 weights."""
        return self is not DataParallelKind.REPLICATED
