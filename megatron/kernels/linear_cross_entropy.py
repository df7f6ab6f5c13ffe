"""The output layer and its cross-entropy fused, without ever storing the [N, V] logits.

`cross_entropy(F.linear(hidden, weight), labels)` keeps the logits [N, V] alive from the forward
to the backward (32 x 1024 tokens at a 50,304-word vocabulary is 3.3 GB in bf16) only to reduce
them to N losses. Here rows are taken `chunk_rows` at a time: the forward computes one chunk's
logits, reduces them with the fused cross-entropy kernel to losses and log-sum-exp (lse), and drops
them before the next chunk. Saved for backward are hidden [N, h], weight [V, h], labels [N] and lse
(fp32 [N]); the backward recomputes each chunk's logits, turns them into
grad_logits = (softmax - onehot(label)) * grad_loss with the same kernels, and multiplies them out
into grad_hidden = grad_logits @ weight and grad_weight += grad_logits^T @ hidden (fp32).
Peak extra memory is one chunk's logits forward and one chunk's logits and their gradient
backward, instead of [N, V]; the price is one more forward product of the output layer in the
backward, a third more of the output layer's FLOPs (three products become four).

Ignore_index rows give loss 0 and a zero gradient, as in `megatron.kernels.cross_entropy`.
Dtypes follow F.linear: under autocast the product runs in the autocast dtype; otherwise a weight
of another dtype than hidden's is cast to hidden's. The weight is cast inside, so its gradient is
accumulated in fp32 and returned in the weight's own dtype (an fp32 master weight gets an fp32
gradient without a round trip through bf16).

liger-kernel's fused linear cross-entropy and Apple's cut-cross-entropy do the same; this project
has its own because it needs unreduced per-token losses (the caller applies the loss mask and
reduction) and its cross-entropy kernels, with their references and AOT builds, already exist.
This module adds no kernel of its own (no AOT_SPECS).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron.kernels.cross_entropy import cross_entropy_backward, cross_entropy_forward

__all__ = ["default_chunk_rows", "linear_cross_entropy"]

# One chunk's logits: big enough that each chunk's product is a GEMM of thousands of rows at a
# GPT-2 vocabulary (2,668 bf16 rows of 50,304 words), which keeps the GPU at its matmul rate,
# and small next to the [N, V] logits it replaces (3.3 GB at 32 x 1024 tokens); the backward
# holds two such buffers (the logits and their gradient).
CHUNK_LOGITS_BYTES = 256 * 2**20


def default_chunk_rows(vocab_size: int, dtype: torch.dtype) -> int:
    """Rows whose [rows, vocab_size] logits in `dtype` take about CHUNK_LOGITS_BYTES; at least 1."""
    row_bytes = vocab_size * torch.empty((), dtype=dtype).element_size()
    return max(1, CHUNK_LOGITS_BYTES // max(1, row_bytes))


class _LinearCrossEntropy(torch.autograd.Function):
    """losses[n] = cross_entropy(hidden[n] @ weight^T, labels[n]), chunk_rows rows at a time.

    Runs with autocast off (the caller picks the dtype): hidden arrives in the compute dtype and
    the weight is cast to it here, in forward and again in backward, so that the original weight
    (alive anyway as a parameter) is what is saved.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, chunk_rows):
        rows = hidden.shape[0]
        compute_weight = weight.to(hidden.dtype)
        losses = hidden.new_empty(rows, dtype=torch.float32)
        lse = hidden.new_empty(rows, dtype=torch.float32)
        for start in range(0, rows, chunk_rows):
            end = min(start + chunk_rows, rows)
            logits = F.linear(hidden[start:end], compute_weight)
            losses[start:end], lse[start:end] = cross_entropy_forward(
                logits, labels[start:end], ignore_index
            )
            # Dropped before the next chunk's product, so that two chunks never coexist.
            del logits
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.ignore_index = ignore_index
        ctx.chunk_rows = chunk_rows
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        hidden, weight, labels, lse = ctx.saved_tensors
        needs_hidden, needs_weight = ctx.needs_input_grad[:2]
        if not (needs_hidden or needs_weight):
            return None, None, None, None, None
        rows = hidden.shape[0]
        # The product must be recomputed exactly as in forward, whatever autocast the backward
        # is called under.
        with torch.autocast(hidden.device.type, enabled=False):
            compute_weight = weight.to(hidden.dtype)
            # A grad from .sum() or a mask multiply arrives expanded (stride 0).
            grad_losses = grad_losses.contiguous()
            grad_hidden = torch.empty_like(hidden) if needs_hidden else None
            grad_weight = (
                torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                if needs_weight
                else None
            )
            for start in range(0, rows, ctx.chunk_rows):
                end = min(start + ctx.chunk_rows, rows)
                hidden_chunk = hidden[start:end]
                logits = F.linear(hidden_chunk, compute_weight)
                grad_logits = cross_entropy_backward(
                    logits,
                    labels[start:end],
                    lse[start:end],
                    grad_losses[start:end],
                    ctx.ignore_index,
                )
                del logits
                if needs_hidden:
                    grad_hidden[start:end] = grad_logits @ compute_weight
                if needs_weight:
                    # Each chunk's product is rounded once to the compute dtype; their sum is
                    # fp32, so the chunk count does not add rounding steps of the weight's grad.
                    grad_weight += grad_logits.t() @ hidden_chunk
                del grad_logits
        if needs_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would multiply in: autocast's where it is on, else hidden's."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    chunk_rows: Optional[int] = None,
) -> torch.Tensor:
    """fp32 per-token losses [N] of cross_entropy(F.linear(hidden, weight), labels), unreduced.

    hidden [N, h] (bf16, fp16 or fp32), weight [V, h], labels [N] int64. Same values and
    gradients as `megatron.kernels.cross_entropy.cross_entropy` of the logits, under autocast
    as well, without keeping the logits: `chunk_rows` rows at a time (default: about 256 MiB of
    logits a chunk, `default_chunk_rows`).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"linear_cross_entropy takes hidden [N, h] and weight [V, h]; got hidden "
            f"{tuple(hidden.shape)} and weight {tuple(weight.shape)}: flatten hidden with "
            ".view(-1, h) and pass the output layer's weight untransposed"
        )
    if labels.shape != hidden.shape[:1]:
        raise ValueError(
            f"linear_cross_entropy takes labels [N] for hidden [N, h]; got labels "
            f"{tuple(labels.shape)} and hidden {tuple(hidden.shape)}: flatten the labels with "
            ".reshape(-1)"
        )
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"linear_cross_entropy: chunk_rows={chunk_rows}; pass at least 1 or None")
    compute_dtype = _compute_dtype(hidden)
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(weight.shape[0], compute_dtype)
    # The cast of hidden stays outside the Function, so autograd casts its gradient back.
    hidden = hidden.to(compute_dtype)
    with torch.autocast(hidden.device.type, enabled=False):
        return _LinearCrossEntropy.apply(
            hidden, weight, labels.contiguous(), ignore_index, chunk_rows
        )
