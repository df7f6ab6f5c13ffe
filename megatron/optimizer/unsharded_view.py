"""The distributed optimizer as megatron.checkpointing sees a `MegatronOptimizer`: its state
unsharded over data parallelism (megatron.optimizer.distributed_optimizer)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional

if TYPE_CHECKING:
    from megatron.optimizer.distributed_optimizer import DistributedOptimizer


class UnshardedView:
    """A `DistributedOptimizer` as megatron.checkpointing sees the `MegatronOptimizer` of the
    same rank: `param_groups` over the model's parameters (whose attributes say which are
    tensor-parallel or expert shards, or a pipeline stage's), `state_dict()` the gathered
    unsharded state, and `load_state_dict` taking this rank's data-parallel shard of such a
    state. The tensor-, expert- and pipeline-parallel gathering and cutting of checkpoints then
    apply to it unchanged, so its checkpoints hold the single-process state."""

    def __init__(self, optimizer: DistributedOptimizer, full_state: Optional[Dict[str, Any]]):
        self._optimizer = optimizer
        self._full_state = full_state
        self.param_groups = [
            {**{key: value for key, value in group.items() if key != "params"}, "params": params}
            for group, params in zip(optimizer.param_groups, optimizer.model_param_groups)
        ]

    def state_dict(self) -> Dict[str, Any]:
        """The state gathered when the view was made."""
        if self._full_state is None:
            raise RuntimeError(
                "this view was made without gathering the state; call "
                "DistributedOptimizer.unsharded_view(gather=True) on every rank first"
            )
        return self._full_state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Take this rank's shard of an unsharded state of this rank's parameters."""
        self._optimizer.load_full_state_dict(state_dict)
