"""Gradient synchronization of the training step, carried by `GradientSync`: the data-parallel
wrapper, and the reductions that finish a step's gradients after the last backward
(Megatron-core's `finalize_model_grads`). Each data-parallel mode says who reduces its
gradients (megatron.parallelize.data_parallel); a replicated model's choice among torch DDP,
one all-reduce after the last backward and none is `replicated_reduction`.

Which gradient is reduced where:
- replicated parameters: averaged over the data-parallel group by torch DDP, bucketed and
  overlapped with the last micro-batch's backward; or by the distributed optimizer's
  reduce-scatter; or, under a pipeline or with main gradients, by one all-reduce after the
  last backward;
- expert-parallel shards (megatron.parallel.expert_parameters): left out of DDP, since each rank of an
  expert-parallel group holds different experts; `GradientSync.after_backwards` sums them over
  the expert-data-parallel group and divides by the data-parallel size
  (`reduce_expert_gradients`);
- with --sequence-parallel, the norms' partial gradients: summed over the tensor-parallel group;
- under pipeline parallelism with tied embeddings, the first stage's word embeddings and the
  last stage's copy of them: summed over the embedding group (`reduce_tied_embedding_gradients`);
  and no DDP: `all_reduce_data_parallel_gradients` averages over the data-parallel group.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megatron.config import Config
from megatron.main_grads import gradient
from megatron.parallel import parallel_state
from megatron.parallel.expert_parameters import is_expert_parameter, reduce_expert_gradients
from megatron.pipeline.stages import tied_embedding_weights
from megatron.tensor_parallel import all_reduce_sequence_parallel_grads


def wrap_data_parallel(
    model: nn.Module, device: torch.device, data_parallel_group: Optional[dist.ProcessGroup]
) -> nn.parallel.DistributedDataParallel:
    """`model` in torch DDP over `data_parallel_group`, expert-parallel shards left out.

    DDP's bucketed all-reduce starts while backward is still running; it runs over the replicas
    only (tensor-parallel peers hold different shards). Expert shards are excluded from its
    reduction and from its start-up broadcast of rank 0's parameters, which would overwrite
    the other ranks' experts.
    """
    ignored = data_parallel_ignored_names(model)
    if ignored:
        # torch's private but long-standing way to exclude parameters (torch 1.x through
        # 2.13); the names are those of `model.named_parameters()`, the module DDP wraps. Its
        # bucketing spells a parameter of that module itself ".name" (f"{module_name}.{name}"
        # with an empty module name): both spellings, or such a parameter is still reduced.
        ignored += [f".{name}" for name in ignored if "." not in name]
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, ignored
        )
    return nn.parallel.DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        broadcast_buffers=False,
        gradient_as_bucket_view=True,
        process_group=data_parallel_group,
    )


def data_parallel_ignored_names(model: nn.Module) -> List[str]:
    """Fully-qualified names of the parameters DDP must not touch: the expert shards."""
    return [name for name, param in model.named_parameters() if is_expert_parameter(param)]


def micro_batch_context(model: nn.Module, index: int, count: int) -> ContextManager:
    """DDP's no_sync for every micro-batch but the last, so gradients are all-reduced once."""
    ddp = getattr(model, "_orig_mod", model)  # see through torch.compile
    if isinstance(ddp, nn.parallel.DistributedDataParallel) and index < count - 1:
        return ddp.no_sync()
    return contextlib.nullcontext()


# Who averages the replicated parameters' gradients over the data-parallel group.
NO_REDUCTION = "none"  # one replica
DDP = "ddp"  # torch DDP, bucketed and overlapped with the last micro-batch's backward
AFTER_BACKWARD = "after backward"  # one all-reduce after the last backward (pipeline, main grads)
OPTIMIZER = "optimizer"  # the distributed optimizer's reduce-scatter (megatron.optimizer)
FULLY_SHARD = "fully shard"  # FSDP2's reduce-scatter in the backward (torch's fully_shard)


def replicated_reduction(config: Config) -> str:
    """Who averages a replicated model's gradients (the `Replicated` mode's choice, from the
    config alone: the memory planner asks before any process group exists). Not torch DDP under
    a pipeline (its hooks assume one forward then one backward per micro-batch; the 1F1B
    schedules interleave them) or with main gradients (megatron.main_grads: DDP reduces
    `.grad`)."""
    parallel = config.parallel
    if parallel.data_parallel_size == 1:
        return NO_REDUCTION
    if parallel.pipeline_model_parallel_size > 1 or config.numerics.main_grads_dtype is not None:
        return AFTER_BACKWARD
    return DDP


@dataclass(frozen=True)
class GradientSync:
    """A run's gradient synchronization, which its data-parallel mode calls after the last
    backward (and wraps the model in DDP for when `in_ddp`). `reduction`: who averages the
    gradients over the data-parallel group, the mode's answer. `reduces_expert_gradients`:
    whether the expert-parallel shards' gradients are averaged here after the backward, also
    the mode's answer (the sharding modes reduce-scatter them with the rest)."""

    reduction: str
    pipeline: bool = False
    sequence_parallel: bool = False
    expert_parallel: bool = False
    reduces_expert_gradients: bool = False

    @classmethod
    def of(cls, config: Config, reduction: str, reduces_expert_gradients: bool) -> GradientSync:
        expert_parallel = config.parallel.expert_model_parallel_size > 1
        return cls(
            reduction=reduction,
            pipeline=config.parallel.pipeline_model_parallel_size > 1,
            sequence_parallel=config.model.sequence_parallel,
            expert_parallel=expert_parallel,
            reduces_expert_gradients=expert_parallel and reduces_expert_gradients,
        )

    @property
    def in_ddp(self) -> bool:
        """Whether torch DDP reduces the gradients (its hooks then wait on autograd's
        accumulation)."""
        return self.reduction == DDP

    def after_backwards(self, model: nn.Module) -> None:
        """The reductions left after the last micro-batch's backward, before the optimizer
        reads the gradients (Megatron-Core's `finalize_model_grads`); `model` is the unwrapped
        model (under a pipeline this rank's chunks). Every rank must call it."""
        if self.reduction == AFTER_BACKWARD:
            all_reduce_data_parallel_gradients(model)
        if self.pipeline:
            reduce_tied_embedding_gradients(list(model))
        if self.sequence_parallel:
            # Norms saw only this rank's sequence shard: sum their gradients over TP ranks.
            all_reduce_sequence_parallel_grads(model.parameters())
        if self.reduces_expert_gradients:
            # Expert gradients hold the contributions of the expert-parallel group's tokens;
            # this turns them into the data-parallel average DDP gives the other parameters.
            reduce_expert_gradients(model)


def reduce_tied_embedding_gradients(model_chunks: Sequence[nn.Module]) -> None:
    """Sum the tied word embeddings' gradients over the first and last pipeline stage, so both
    copies take the same update and stay equal (Megatron's embedding-group all-reduce).

    Every rank of the embedding group must call it; other ranks (and runs without a pipeline)
    have nothing to do.
    """
    for weight in tied_embedding_weights(list(model_chunks)):
        if gradient(weight) is None:
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(gradient(weight), group=parallel_state.get_embedding_group())


def all_reduce_data_parallel_gradients(model: nn.Module) -> None:
    """Average every gradient over the data-parallel group, after the last backward: the
    pipeline's replacement for DDP, whose hooks assume one forward then one backward per
    micro-batch (the 1F1B schedules interleave them). Unbucketed: one all-reduce of all
    gradients flattened. Expert-parallel shards are left to `reduce_expert_gradients`, as DDP
    leaves them."""
    size = parallel_state.get_data_parallel_world_size()
    grads = [
        gradient(param)
        for param in model.parameters()
        if gradient(param) is not None and not is_expert_parameter(param)
    ]
    if size == 1 or not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=parallel_state.get_data_parallel_group())
    flat /= size
    for grad, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        grad.copy_(reduced)
