"""The trainer's view of a pipeline (megatron.parallelize.steps.split_pipeline builds the stages): one
step's forwards and backwards through the schedule, and the reported values of every stage
combined on every rank (rank 0 logs them, as without a pipeline)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict, Iterator, List

import torch
import torch.distributed as dist
from torch import nn

from megatron.parallel import parallel_state
from megatron.pipeline.p2p import ActivationSpec
from megatron.pipeline.schedules import (
    StageForwardStep,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    forward_only_pipelining,
)

if TYPE_CHECKING:
    from megatron.config import Config


def activation_spec(config: Config, device: torch.device) -> ActivationSpec:
    """The [micro_batch, seq, hidden] (seq / tp with sequence parallelism) fp32 tensors sent
    between stages: the residual stream stays fp32 under autocast."""
    seq_length = config.data.seq_length
    if config.model.sequence_parallel:
        seq_length //= config.parallel.tensor_model_parallel_size
    shape = (config.training.micro_batch_size, seq_length, config.model.hidden_size)
    return ActivationSpec(shape, torch.float32, device)


def pipeline_step(
    model: nn.ModuleList,
    forward_step: StageForwardStep,
    data_iterator: Iterator,
    config: Config,
    spec: ActivationSpec,
    scale_loss: Callable[[torch.Tensor], torch.Tensor],
    forward_only: bool = False,
) -> Dict[str, torch.Tensor]:
    """One global batch's micro-batches through the pipeline (backwards too unless
    `forward_only`); the reported values averaged over micro-batches, on every rank of the
    pipeline. A value reported by several stages (an MoE auxiliary loss, each stage's share
    from its own layers) is the sum of their shares."""
    num_micro_batches = config.training.num_micro_batches
    chunks = list(model)
    if forward_only:
        reported = forward_only_pipelining(
            forward_step, data_iterator, chunks, num_micro_batches, spec
        )
    elif parallel_state.get_virtual_pipeline_model_parallel_world_size() is None:
        reported = forward_backward_pipelining_without_interleaving(
            forward_step, data_iterator, chunks[0], num_micro_batches, spec, scale_loss
        )
    else:
        reported = forward_backward_pipelining_with_interleaving(
            forward_step, data_iterator, chunks, num_micro_batches, spec, scale_loss
        )
    sums = _sum_over_stages(reported)
    return {
        name: torch.tensor(value / num_micro_batches, device=spec.device)
        for name, value in sums.items()
    }


def _sum_over_stages(reported: Dict[str, torch.Tensor]) -> Dict[str, float]:
    # Stages report different names (only the last knows "lm loss"): an object all-gather
    # carries names and values; adding in stage order gives every rank the same sums.
    local = {name: value.item() for name, value in reported.items()}
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    gathered: List[Dict[str, float]] = [{} for _ in range(stages)]
    dist.all_gather_object(
        gathered, local, group=parallel_state.get_pipeline_model_parallel_group()
    )
    sums: Dict[str, float] = {}
    for stage in gathered:
        for name, value in stage.items():
            sums[name] = sums.get(name, 0.0) + value
    return sums
