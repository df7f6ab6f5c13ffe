"""The distributed optimizer's gradient reduce-scatter, bucket by bucket, and with
`--overlap-grad-reduce` during the last micro-batch's backward (Megatron-Core's overlapped
grad reduce).

Buckets. Without overlap a replica group's parameters are one bucket, reduced after the
backward. With it they are cut into buckets in the reverse of the model's order (the backward
writes the last layers' gradients first), each closed once it holds at least `bucket_size`
elements; a bucket is reduce-scattered as soon as the last backward has written the gradient of
every parameter in it, while the backward goes on with earlier layers. Gradients that change
after the backward (the norms' partial sums under sequence parallelism, summed over the
tensor-parallel group by megatron.parallelize.gradient_sync.GradientSync.after_backwards) go in a last
bucket reduced at the step.

When a gradient is written: autograd's post-accumulate-grad hook on the parameter, or where a
layer adds gradients itself (moe.weight_copies.GradientAccumulator, for the compute-dtype copies
of expert weights), its call of `megatron.main_grads.gradient_written`.

Order. NCCL needs every rank of a group to issue the group's collectives in one order: each
group's buckets launch in bucket order, bucket k only after buckets 0..k-1, whatever order the
hooks fire in.

Granularity. A backward compiled as one graph writes every gradient at its end; with this
overlap megatron.parallelize.steps compiles the model layer by layer instead.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch.distributed as dist
from torch import nn

from megatron.main_grads import on_gradient_written
from megatron.optimizer.sharded_buffer import ShardedBuffer


def default_bucket_size(data_parallel_size: int) -> int:
    """Megatron's: 40 million parameters, or a million per data-parallel rank if more."""
    return max(40_000_000, 1_000_000 * data_parallel_size)


def changes_after_backward(param: nn.Parameter) -> bool:
    """A parameter whose gradient is summed over the tensor-parallel group after the backward."""
    return bool(getattr(param, "sequence_parallel", False))


def bucket_parameters(
    params: Sequence[nn.Parameter],
    bucket_size: Optional[int],
    model_order: Optional[Sequence[nn.Parameter]] = None,
) -> List[List[nn.Parameter]]:
    """`params` (one replica group's) as buckets in launch order: all in one, as given, with no
    `bucket_size`; else see the module docstring. The buckets follow `model_order` (the model's
    `parameters()`, which the backward writes in reverse; default: as given), not the order of
    the optimizer's param groups (weights, then biases and norms), which would put the first
    layer's biases in the first bucket to fill."""
    if bucket_size is None:
        return [list(params)]
    position = {id(param): index for index, param in enumerate(model_order or params)}
    params = sorted(params, key=lambda param: position.get(id(param), len(position)))
    buckets: List[List[nn.Parameter]] = []
    current: List[nn.Parameter] = []
    numel = 0
    for param in reversed(params):
        if changes_after_backward(param):
            continue
        current.append(param)
        numel += param.numel()
        if numel >= bucket_size:
            buckets.append(current)
            current, numel = [], 0
    if current:
        buckets.append(current)
    late = [param for param in params if changes_after_backward(param)]
    return buckets + ([late] if late else [])


class GradReduce:
    """The reduce-scatters of `queues` (per replica group, its buckets in launch order).

    `overlap`: hooks watch the gradients, and after `arm` (before the last micro-batch's
    backward) each bucket launches once all its gradients are written; `finish` launches the
    rest, waits for all and divides. Without it `finish` does everything. `reset` (before the
    gradients are zeroed) waits for anything in flight of a step that runs again.
    """

    def __init__(self, queues: Sequence[Sequence[ShardedBuffer]], overlap: bool) -> None:
        self.queues = [list(queue) for queue in queues]
        self._armed = False
        self._written = [[set() for _ in queue] for queue in self.queues]
        self._works: List[List[Optional[dist.Work]]] = [[] for _ in self.queues]
        if not overlap:
            return
        for q, queue in enumerate(self.queues):
            for b, bucket in enumerate(queue):
                for index, param in enumerate(bucket.params):
                    if changes_after_backward(param):
                        continue

                    def written(_, where=(q, b, index)) -> None:
                        self._on_written(*where)

                    param.register_post_accumulate_grad_hook(written)
                    on_gradient_written(param, written)

    def arm(self) -> None:
        """The next backward is the step's last: launch buckets as their gradients are done."""
        self._armed = True

    def _on_written(self, q: int, b: int, index: int) -> None:
        if not self._armed:
            return
        bucket = self.queues[q][b]
        bucket.collect_grad(index)
        self._written[q][b].add(index)
        queue, works = self.queues[q], self._works[q]
        while len(works) < len(queue) and len(self._written[q][len(works)]) == len(
            queue[len(works)].params
        ):
            works.append(queue[len(works)].start_reduce_scatter())

    def launched_buckets(self) -> int:
        """Buckets whose reduce-scatter has started this step."""
        return sum(len(works) for works in self._works)

    def finish(self) -> None:
        """Every bucket reduce-scattered and divided: this rank's shard gradients are ready."""
        for queue, works in zip(self.queues, self._works):
            for bucket in queue[len(works) :]:
                bucket.collect_grads()
                works.append(bucket.start_reduce_scatter())
            for bucket, work in zip(queue, works):
                bucket.finish_reduce_scatter(work)
        self._clear()

    def reset(self) -> None:
        """Drop a step's reductions (waiting for those in flight, which read the buffers)."""
        for works in self._works:
            for work in works:
                if work is not None:
                    work.wait()
        self._clear()

    def _clear(self) -> None:
        self._armed = False
        self._written = [[set() for _ in queue] for queue in self.queues]
        self._works = [[] for _ in self.queues]
