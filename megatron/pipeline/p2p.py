"""Point-to-point exchange between pipeline stages: activations forward, their gradients back.

Every exchange is one `torch.distributed.batch_isend_irecv` call, so a stage that sends and
receives in the same step cannot deadlock on the order of blocking calls. The shapes are known
up front (``[micro_batch, seq, hidden]``, or ``[micro_batch, seq / tp, hidden]`` with sequence
parallelism), so no shape is exchanged.

With two stages the next and the previous rank are the same process, which then receives both
an activation and a gradient from one peer. Two things keep them apart: activations travel
with tag 0 and gradients with tag 1 (gloo matches by tag), and every rank posts its operations
in one order, activations first (NCCL ignores tags and matches by order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.parallel import parallel_state

ACTIVATION_TAG = 0
GRADIENT_TAG = 1


@dataclass(frozen=True)
class ActivationSpec:
    """Shape, dtype and device of every tensor exchanged between stages."""

    shape: Sequence[int]
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")


def communicate(
    tensor_send_next: Optional[torch.Tensor],
    tensor_send_prev: Optional[torch.Tensor],
    recv_prev: bool,
    recv_next: bool,
    spec: ActivationSpec,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Send an activation to the next stage and a gradient to the previous one, and receive
    the previous stage's activation and the next stage's gradient, in one batch.

    Returns ``(from_prev, from_next)``; an entry is None when not asked for. Received tensors
    require grad, so that backward through this stage leaves the gradient to send back in
    their ``.grad``.
    """
    group = parallel_state.get_pipeline_model_parallel_group()
    next_rank = parallel_state.get_pipeline_model_parallel_next_rank()
    prev_rank = parallel_state.get_pipeline_model_parallel_prev_rank()

    def buffer() -> torch.Tensor:
        return torch.empty(
            tuple(spec.shape), dtype=spec.dtype, device=spec.device, requires_grad=True
        )

    from_prev = buffer() if recv_prev else None
    from_next = buffer() if recv_next else None
    operations: List[dist.P2POp] = []
    # Activations (next-ward) first, then gradients (prev-ward): the same order on every rank.
    if tensor_send_next is not None:
        payload = tensor_send_next.detach().to(spec.dtype).contiguous()
        operations.append(dist.P2POp(dist.isend, payload, next_rank, group, ACTIVATION_TAG))
    if from_prev is not None:
        operations.append(dist.P2POp(dist.irecv, from_prev, prev_rank, group, ACTIVATION_TAG))
    if tensor_send_prev is not None:
        payload = tensor_send_prev.detach().to(spec.dtype).contiguous()
        operations.append(dist.P2POp(dist.isend, payload, prev_rank, group, GRADIENT_TAG))
    if from_next is not None:
        operations.append(dist.P2POp(dist.irecv, from_next, next_rank, group, GRADIENT_TAG))
    if operations:
        for request in dist.batch_isend_irecv(operations):
            request.wait()
    return from_prev, from_next


# The wrappers of the non-interleaved schedule: a stage without a neighbour on that side (the
# first has no previous stage, the last no next one) neither sends nor receives there.
def recv_forward(spec: ActivationSpec) -> Optional[torch.Tensor]:
    """The previous stage's activation (None on the first stage)."""
    if parallel_state.is_pipeline_first_stage():
        return None
    return communicate(None, None, True, False, spec)[0]


def recv_backward(spec: ActivationSpec) -> Optional[torch.Tensor]:
    """The gradient of this stage's output from the next stage (None on the last stage)."""
    if parallel_state.is_pipeline_last_stage():
        return None
    return communicate(None, None, False, True, spec)[1]


def send_forward(output_tensor: Optional[torch.Tensor], spec: ActivationSpec) -> None:
    """Send this stage's activation to the next stage (nothing on the last stage)."""
    if not parallel_state.is_pipeline_last_stage():
        communicate(output_tensor, None, False, False, spec)


def send_backward(input_grad: Optional[torch.Tensor], spec: ActivationSpec) -> None:
    """Send the gradient of this stage's input to the previous stage (nothing on the first)."""
    if not parallel_state.is_pipeline_first_stage():
        communicate(None, input_grad, False, False, spec)


def send_forward_recv_backward(
    output_tensor: Optional[torch.Tensor], spec: ActivationSpec
) -> Optional[torch.Tensor]:
    """Send the activation on and receive its gradient back (None on the last stage)."""
    if parallel_state.is_pipeline_last_stage():
        return None
    return communicate(output_tensor, None, False, True, spec)[1]


def send_backward_recv_forward(
    input_grad: Optional[torch.Tensor], spec: ActivationSpec
) -> Optional[torch.Tensor]:
    """Send the input's gradient back and receive the next activation (None on the first)."""
    if parallel_state.is_pipeline_first_stage():
        return None
    return communicate(None, input_grad, True, False, spec)[0]
