"""A flat buffer of parameters and one of their gradients, sharded over a replica group: the
storage of the distributed optimizer (megatron/optimizer/distributed_optimizer.py describes
the layout)."""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from megatron.main_grads import MainGradBuffer
from megatron.parallel.collectives import all_gather_single as _all_gather
from megatron.parallel.collectives import reduce_scatter_single as _reduce_scatter
from megatron.parallel.expert_parameters import is_expert_parameter


class ShardedBuffer:
    """The parameters of one dtype and replica group, flat and padded to split evenly into
    shards over that group (`size` ranks, this one `rank`).

    The parameters become views into `param_buffer`; `grad_buffer` has the same layout, and
    `shard_grad` receives this rank's shard of the reduced gradients. Gradients are divided by
    `grad_divisor` after the sum over the group. With a `grad_dtype` other than the parameters'
    (`--main-grads-dtype bf16`) the grad buffer holds main gradients (megatron.main_grads):
    each parameter's `main_grad` is its view, filled by a hook, and `.grad` stays None.

    With a `compute_dtype` (the fp32 parameters of a bf16 or fp16 run that autocast would cast
    to it anyway), the parameter buffer is of that dtype and the fp32 values are kept only as
    this rank's shard, `master_shard`, which the optimizer steps; the gradients are fp32 main
    gradients (or `grad_dtype`'s), and `start_all_gather` rounds the master shard into the
    parameter buffer's before gathering the compute-dtype bytes.
    """

    def __init__(
        self,
        params: List[nn.Parameter],
        group: Optional[dist.ProcessGroup],
        size: int,
        rank: int,
        grad_divisor: int,
        grad_dtype: Optional[torch.dtype] = None,
        compute_dtype: Optional[torch.dtype] = None,
    ) -> None:
        self.params = params
        self.group = group
        self.size = size
        self.grad_divisor = grad_divisor
        self.expert = is_expert_parameter(params[0])
        self.offsets: List[int] = []
        self.numel = 0
        for param in params:
            self.offsets.append(self.numel)
            self.numel += param.numel()
        self.shard_size = -(-self.numel // size)  # ceil: the padding goes at the end
        self.shard_start = rank * self.shard_size
        padded = self.shard_size * size
        dtype, device = params[0].dtype, params[0].device
        grad_dtype = grad_dtype or dtype
        full = torch.zeros(padded, dtype=dtype, device=device)
        with torch.no_grad():
            for param, offset in zip(params, self.offsets):
                full[offset : offset + param.numel()].copy_(param.detach().reshape(-1))
        # Every replica takes the group's first rank's parameters, as DDP at construction.
        if size > 1:
            source = dist.get_global_rank(group, 0) if group is not None else 0
            dist.broadcast(full, src=source, group=group)
        self.master_shard: Optional[torch.Tensor] = None
        self.param_buffer = full
        if compute_dtype is not None and compute_dtype != dtype:
            self.master_shard = self._shard_of(full).clone()
            self.param_buffer = full.to(compute_dtype)
            del full
        self.grad_buffer = torch.zeros(padded, dtype=grad_dtype, device=device)
        # A group of one rank reduces nothing: its shard is the whole buffer, in place.
        self.shard_grad = (
            self.grad_buffer
            if size == 1
            else torch.zeros(self.shard_size, dtype=grad_dtype, device=device)
        )
        # Compute-dtype parameters always add each micro-batch's gradient into an fp32 (or
        # `grad_dtype`) main gradient, as the fp32 parameters' cast would.
        self.main_grads = (
            MainGradBuffer(params, grad_dtype, self.grad_buffer, self.offsets)
            if grad_dtype != dtype or self.master_shard is not None
            else None
        )
        self._point_params_into(self.param_buffer)

    def _point_params_into(self, flat: torch.Tensor) -> None:
        """Make every parameter a view of its slice of `flat` (a buffer of this layout)."""
        for param, offset in zip(self.params, self.offsets):
            param.data = flat[offset : offset + param.numel()].view_as(param)

    def _shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard of `flat` (a buffer of this layout)."""
        return flat[self.shard_start : self.shard_start + self.shard_size]

    @property
    def param_shard(self) -> torch.Tensor:
        """This rank's shard of the parameter buffer."""
        return self._shard_of(self.param_buffer)

    @property
    def step_shard(self) -> torch.Tensor:
        """What the optimizer steps: the fp32 master shard, or the parameters' own shard."""
        return self.param_shard if self.master_shard is None else self.master_shard

    @contextlib.contextmanager
    def full_precision(self) -> Iterator[None]:
        """Within it the parameters hold their fp32 values, gathered from every rank's master
        shard (a collective), for a checkpoint to save or load; what they hold at its end
        becomes the master shard and, rounded, the parameters. Nothing without master shards."""
        if self.master_shard is None:
            yield
            return
        full = torch.empty_like(self.param_buffer, dtype=self.master_shard.dtype)
        if self.size > 1:
            all_gather_into(full, self.master_shard, self.group)
        else:
            full.copy_(self.master_shard)
        self._point_params_into(full)
        try:
            yield
        finally:
            with torch.no_grad():
                self.master_shard.copy_(self._shard_of(full))
                self.param_buffer.copy_(full)
            self._point_params_into(self.param_buffer)

    @property
    def local_numel(self) -> int:
        """Parameter elements in this rank's shard, padding excluded."""
        return max(0, min(self.shard_size, self.numel - self.shard_start))

    def grad_view(self, index: int) -> torch.Tensor:
        """The grad buffer's slice for `params[index]`, shaped like it."""
        param, offset = self.params[index], self.offsets[index]
        return self.grad_buffer[offset : offset + param.numel()].view_as(param)

    def local_range(self, index: int) -> Optional[Tuple[int, int]]:
        """`(start, end)` of `params[index].view(-1)` inside the local shard, or None."""
        offset = self.offsets[index]
        start = max(offset, self.shard_start)
        end = min(offset + self.params[index].numel(), self.shard_start + self.shard_size)
        return (start - offset, end - offset) if start < end else None

    def bind_grads(self) -> None:
        """Zero the grad buffer and make every `param.grad` its view, for backward to fill
        (main gradients: they are views already)."""
        if self.main_grads is not None:
            self.main_grads.zero()
            return
        self.grad_buffer.zero_()
        for index, param in enumerate(self.params):
            param.grad = self.grad_view(index)

    def collect_grads(self) -> None:
        """Bring grads that do not live in the buffer (None, or re-created) into it."""
        for index in range(len(self.params)):
            self.collect_grad(index)

    def collect_grad(self, index: int) -> None:
        """`collect_grads` for `params[index]` alone."""
        if self.main_grads is not None:
            return  # the hooks added every gradient into the buffer
        param, view = self.params[index], self.grad_view(index)
        if param.grad is None:
            view.zero_()
        elif param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)

    def start_reduce_scatter(self) -> Optional[dist.Work]:
        """Start summing this rank's shard of the grad buffer over the group: the collective's
        handle (None when there is nothing to wait for). The grad buffer must not change until
        `finish_reduce_scatter`."""
        if self.size == 1:
            return None  # shard_grad is the grad buffer
        return _reduce_scatter(self.shard_grad, self.grad_buffer, group=self.group, async_op=True)

    def finish_reduce_scatter(self, work: Optional[dist.Work]) -> None:
        """Wait for `start_reduce_scatter`'s collective (on GPUs: the current stream waits),
        then divide by `grad_divisor` (after the sum it touches 1/size of the elements)."""
        if work is not None:
            work.wait()
        if self.grad_divisor > 1:
            self.shard_grad.div_(self.grad_divisor)

    def all_gather_params(self) -> None:
        """Every rank's updated shard into every rank's parameter buffer."""
        work = self.start_all_gather()
        if work is not None:
            work.wait()

    def start_all_gather(self) -> Optional[dist.Work]:
        """`all_gather_params` without waiting: the collective's handle (None when there is
        nothing to wait for). The parameters must not be read or written until it is waited
        for (on GPUs: the stream that uses them waits)."""
        if self.master_shard is not None:
            with torch.no_grad():
                self.param_shard.copy_(self.master_shard)  # rounded to the compute dtype
        if self.size == 1:
            return None
        shard = self.param_shard
        # NCCL all-gathers in place (input is the output's own slice); other backends get a
        # separate input so they never read a slice they are writing (the work keeps it).
        if dist.get_backend(self.group) != "nccl":
            shard = shard.clone()
        return _all_gather(self.param_buffer, shard, group=self.group, async_op=True)


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group) -> None:
    """Every rank's `shard` of `group`, in rank order, into the flat `output`."""
    _all_gather(output, shard, group=group)
