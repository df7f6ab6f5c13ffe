"""The distributed optimizer's parameter all-gather after its step, and with
`--overlap-param-gather` left in flight until the next forward needs each bucket (Megatron-Core's
overlapped param gather).

The buckets are megatron.optimizer.grad_reduce's. With overlap, every bucket's all-gather is
launched right after the step, each group's buckets in the model's order (the reverse of the
reduce-scatter's), the same order on every rank as NCCL needs; then nothing waits until a
parameter is needed: the trainer waits for a transformer layer's buckets just before that
layer's forward (megatron.training.trainer), for the rest before the forwards begin, and for all of them
before anything else reads the parameters (a checkpoint) or the next step writes them. On a GPU
a wait is the compute stream's, not the host's: the host runs ahead as before.
"""

from __future__ import annotations

from typing import Dict, Iterable, Sequence, Tuple

import torch.distributed as dist
from torch import nn

from megatron.optimizer.sharded_buffer import ShardedBuffer


class ParamGather:
    """The all-gathers of `queues` (per replica group, its buckets in reduce-scatter order)."""

    def __init__(self, queues: Sequence[Sequence[ShardedBuffer]], overlap: bool) -> None:
        self.queues = [list(queue) for queue in queues]
        self.overlap = overlap
        self._bucket = {
            id(param): (q, b)
            for q, queue in enumerate(self.queues)
            for b, bucket in enumerate(queue)
            for param in bucket.params
        }
        self._in_flight: Dict[Tuple[int, int], dist.Work] = {}

    def start(self) -> None:
        """After the step: without overlap, gather every bucket now; with it, launch them."""
        self.finish()
        for q, queue in enumerate(self.queues):
            for b in reversed(range(len(queue))):
                if not self.overlap:
                    queue[b].all_gather_params()
                    continue
                work = queue[b].start_all_gather()
                if work is not None:
                    self._in_flight[(q, b)] = work

    def wait_for(self, params: Iterable[nn.Parameter]) -> None:
        """Until `params` hold the step's values (buckets already waited for cost nothing)."""
        if not self._in_flight:
            return
        for key in {self._bucket[id(param)] for param in params if id(param) in self._bucket}:
            work = self._in_flight.pop(key, None)
            if work is not None:
                work.wait()

    def finish(self) -> None:
        """Until every parameter holds the step's values."""
        in_flight, self._in_flight = self._in_flight, {}
        for work in in_flight.values():
            work.wait()

    def pending(self) -> int:
        """Buckets launched and not waited for yet."""
        return len(self._in_flight)
