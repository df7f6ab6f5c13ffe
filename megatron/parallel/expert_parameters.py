"""Parameters sharded over the expert-parallel group, and how their gradients are reduced.

A layer whose parameters differ between the ranks of an expert-parallel group (MoE experts,
moe.experts) marks them with `mark_expert_parallel`; DDP, the optimizers and checkpointing read
the mark (`is_expert_parameter`) without knowing which layer set it. The groups themselves belong
to megatron.parallel.parallel_state.

Gradient semantics. After backward, an expert parameter on rank r holds the gradient of the
losses of *all* ranks of its EP group with respect to r's experts (the all-to-all backward brings
those contributions home), while every other parameter holds only its local tokens' gradient.
Data parallelism averages gradients over the D data-parallel ranks, so to match it expert
gradients must be summed over the expert-data-parallel group (the D / P ranks holding the same
experts) and divided by D (equivalently averaged there and divided by P), while the other
gradients are averaged over the whole data-parallel group as usual. Expert parameters are marked
(`expert_model_parallel = True`, MegaBlocks' name, and `allreduce = False`, Megatron-core's)
so that the trainer keeps them out of the data-parallel all-reduce; `reduce_expert_gradients`
does their side.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron.main_grads import gradient
from megatron.parallel import parallel_state


def mark_expert_parallel(param: nn.Parameter) -> None:
    """Mark a parameter sharded over the expert-parallel group: the trainer must not all-reduce
    its gradient over data parallelism but call `reduce_expert_gradients` instead."""
    param.expert_model_parallel = True
    param.allreduce = False


def is_expert_parameter(param: torch.Tensor) -> bool:
    """Whether `param` is an expert-parallel shard (see `mark_expert_parallel`)."""
    return getattr(param, "expert_model_parallel", False)


def expert_parameters(model: nn.Module) -> List[nn.Parameter]:
    """The expert-parallel parameters of `model`, in `model.parameters()` order."""
    return [param for param in model.parameters() if is_expert_parameter(param)]


def reduce_expert_gradients(
    model: nn.Module,
    expert_data_parallel_group: Optional[dist.ProcessGroup] = None,
    data_parallel_size: Optional[int] = None,
) -> None:
    """Turn the expert gradients of one step into the data-parallel average (module docstring).

    Sums them over `expert_data_parallel_group` (default: parallel_state's) in one flat
    all-reduce and divides by `data_parallel_size` (default: parallel_state's). Every rank must
    call it; the other parameters' gradients are left for the usual data-parallel reduction.
    """
    grads = [gradient(param) for param in expert_parameters(model) if gradient(param) is not None]
    if not grads:
        return
    if data_parallel_size is None:
        data_parallel_size = parallel_state.get_data_parallel_world_size()
    group = expert_data_parallel_group
    if group is None:
        # None from parallel_state means one process; passed on to torch it would mean the world.
        group = parallel_state.get_expert_data_parallel_group()
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    flat /= data_parallel_size
    for grad, reduced in zip(grads, flat.split([grad.numel() for grad in grads])):
        grad.copy_(reduced.view_as(grad))
