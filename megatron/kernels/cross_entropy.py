"""Fused cross-entropy over a large vocabulary: Triton kernels, the autograd op and its reference.

The GPT output layer's loss, `F.cross_entropy(logits.float(), labels, reduction="none")`, makes an
fp32 copy of the [N, V] logits and runs log-softmax over it. Here the bf16 logits are read in the
fewest passes and never copied to fp32:
- forward, one pass: each program streams one logit row in BLOCK_V chunks, keeps a running max and
  sum of exp(x - max) in fp32 (the online softmax), and writes the row's loss and its log-sum-exp
  (lse, fp32 [N]), the only thing saved for backward besides the logits and labels;
- backward, one pass: grad_logits = (exp(x - lse) - onehot(label)) * grad_loss[row], written in the
  logits' dtype.
Per row of V bf16 logits that is 2V bytes read forward, and 2V read plus 2V written backward.
`cross_entropy_forward` and `cross_entropy_backward` are the two halves outside autograd, for a
caller that recomputes the logits instead of keeping them (megatron.kernels.linear_cross_entropy).

Labels equal to ignore_index (-100 by default, as in F.cross_entropy) give loss 0 and a zero
gradient row. Any other label outside [0, V) cannot be reported without a host sync, so the
kernels make that row's loss NaN and its whole gradient row NaN instead, which the training loop's
NaN check then catches (the reference raises).

On torch >= 2.6 the op is a `torch.library.triton_op` whose forward and backward launch the
kernels through `wrap_triton`, so `torch.compile` traces through it without a graph break and
Inductor sees the kernels themselves; older torch (2.4, 2.5) gets an opaque
`torch.library.custom_op` launching the same kernels: one node in a compiled graph, whose inside
Inductor does not see.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from megatron.kernels.dispatch import TRITON_AVAILABLE, use_triton

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from megatron.kernels.aot import AotSpec

__all__ = [
    "AOT_SPECS",
    "cross_entropy",
    "cross_entropy_backward",
    "cross_entropy_forward",
    "cross_entropy_reference",
]

# 4096 columns per chunk: a 50,304-word vocab is 13 chunks of which the last is 28% full, so 5.8%
# of lanes idle (8192 would idle 14%). With 8 warps each thread holds 16 values (two 16-byte bf16
# loads), few enough registers that 8 rows fit per SM, and 8 KB in flight per row keeps HBM busy.
# Of the chunk sizes tried on an H100 at the GPT-2 vocabulary, 2048 was slower forward and 16384
# slower backward (the kernel's measurements: docs/benchmark-log.md, the fused cross-entropy).
# A smaller vocab gets one chunk of the next power of two.
BLOCK_V = 4096
NUM_WARPS = 8


if TRITON_AVAILABLE:

    @triton.jit
    def _cross_entropy_forward_kernel(
        logits_ptr,
        labels_ptr,
        losses_ptr,
        lse_ptr,
        vocab_size,
        ignore_index,
        BLOCK_V: tl.constexpr,
    ):
        """One row: lse = log(sum(exp(x))) by an online max / sum over BLOCK_V chunks; loss = lse - x[label]."""
        row = tl.program_id(0).to(tl.int64)  # row * vocab_size passes 2^31 at N * V > 2.1e9
        row_ptr = logits_ptr + row * vocab_size
        label = tl.load(labels_ptr + row)
        in_range = (label >= 0) & (label < vocab_size)
        # A direct load of the target logit: one 32-byte sector that the chunk loop then finds in
        # cache, cheaper than a compare, select and reduction on every chunk.
        target = tl.load(row_ptr + label, mask=in_range, other=0.0).to(tl.float32)
        running_max = tl.full((), float("-inf"), tl.float32)
        running_sum = tl.zeros((), tl.float32)
        for start in range(0, vocab_size, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            values = tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf"))
            values = values.to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(values, axis=0))
            # exp(-inf - new_max) = 0 rescales the empty sum of the first chunk and masked lanes add 0.
            running_sum = running_sum * tl.exp(running_max - new_max)
            running_sum += tl.sum(tl.exp(values - new_max), axis=0)
            running_max = new_max
        lse = running_max + tl.log(running_sum)
        loss = tl.where(in_range, lse - target, float("nan"))
        loss = tl.where(label == ignore_index, 0.0, loss)
        tl.store(losses_ptr + row, loss)
        tl.store(lse_ptr + row, lse)

    @triton.jit
    def _cross_entropy_backward_kernel(
        logits_ptr,
        labels_ptr,
        lse_ptr,
        grad_losses_ptr,
        grad_logits_ptr,
        vocab_size,
        ignore_index,
        BLOCK_V: tl.constexpr,
    ):
        """One BLOCK_V chunk of one row: grad = (exp(x - lse) - onehot(label)) * grad_loss[row]."""
        # A 2-D grid (row, chunk): no reduction couples a row's chunks, so no loop is needed.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        mask = cols < vocab_size
        label = tl.load(labels_ptr + row)
        lse = tl.load(lse_ptr + row)
        scale = tl.load(grad_losses_ptr + row).to(tl.float32)
        in_range = (label >= 0) & (label < vocab_size)
        scale = tl.where(in_range, scale, float("nan"))
        scale = tl.where(label == ignore_index, 0.0, scale)
        values = tl.load(logits_ptr + row * vocab_size + cols, mask=mask, other=0.0).to(tl.float32)
        probs = tl.exp(values - lse)
        grad = (probs - tl.where(cols == label, 1.0, 0.0)) * scale
        tl.store(
            grad_logits_ptr + row * vocab_size + cols,
            grad.to(grad_logits_ptr.dtype.element_ty),
            mask=mask,
        )


def _block_v(vocab_size: int) -> int:
    return min(BLOCK_V, triton.next_power_of_2(vocab_size))


def _launcher(kernel: Callable) -> Callable:
    # wrap_triton makes the launch a traceable higher-order op inside a triton_op; it hands back
    # the kernel itself when called outside tracing or on an interpreted (TRITON_INTERPRET) kernel.
    if HAS_TRITON_OP:
        return torch.library.wrap_triton(kernel)
    return kernel


def _forward(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the forward kernel on contiguous [N, V] logits and [N] labels; returns (losses, lse)."""
    rows, vocab_size = logits.shape
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows > 0:
        _launcher(_cross_entropy_forward_kernel)[(rows,)](
            logits,
            labels,
            losses,
            lse,
            vocab_size,
            ignore_index,
            BLOCK_V=_block_v(vocab_size),
            num_warps=NUM_WARPS,
        )
    return losses, lse


def _backward(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    grad_losses: torch.Tensor,
    ignore_index: int,
) -> torch.Tensor:
    """Runs the backward kernel; returns grad_logits [N, V] in the logits' dtype."""
    rows, vocab_size = logits.shape
    grad_logits = torch.empty_like(logits)
    if rows > 0:
        block_v = _block_v(vocab_size)
        _launcher(_cross_entropy_backward_kernel)[(rows, triton.cdiv(vocab_size, block_v))](
            logits,
            labels,
            lse,
            grad_losses,
            grad_logits,
            vocab_size,
            ignore_index,
            BLOCK_V=block_v,
            num_warps=NUM_WARPS,
        )
    return grad_logits


HAS_TRITON_OP = hasattr(torch.library, "triton_op")
# TRITON_INTERPRET=1 (the CPU tests) turns the kernels into interpreted functions, which cannot run
# on the fake tensors torch.compile traces with and which wrap_triton hands back unwrapped. There,
# and on torch < 2.6, which has no triton_op, the ops are opaque custom_ops whose fakes only
# allocate the outputs: compiled graphs still trace without a break and launch the kernels at run
# time, but nothing sees inside the op.
# Without Triton the ops are never called (use_triton is False); they are still defined, opaque.
KERNELS_INTERPRETED = TRITON_AVAILABLE and not isinstance(
    _cross_entropy_forward_kernel, triton.runtime.JITFunction
)
OPS_OPAQUE = not TRITON_AVAILABLE or KERNELS_INTERPRETED or not HAS_TRITON_OP

_define_op = torch.library.custom_op if OPS_OPAQUE else torch.library.triton_op
# Schemas spelled out: torch 2.4 cannot infer them from this module's postponed annotations.
_forward_op = _define_op(
    "megatron::cross_entropy_forward",
    _forward,
    mutates_args=(),
    schema="(Tensor logits, Tensor labels, int ignore_index) -> (Tensor, Tensor)",
)
_backward_op = _define_op(
    "megatron::cross_entropy_backward",
    _backward,
    mutates_args=(),
    schema="(Tensor logits, Tensor labels, Tensor lse, Tensor grad_losses, int ignore_index) -> Tensor",
)
if OPS_OPAQUE:

    @_forward_op.register_fake
    def _(logits, labels, ignore_index):
        rows = logits.shape[0]
        return logits.new_empty(rows, dtype=torch.float32), logits.new_empty(
            rows, dtype=torch.float32
        )

    @_backward_op.register_fake
    def _(logits, labels, lse, grad_losses, ignore_index):
        return torch.empty_like(logits)


def _setup_context(ctx, inputs, output) -> None:
    logits, labels, ignore_index = inputs
    _, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(logits, labels, lse)
    ctx.ignore_index = ignore_index


def _backward_of_forward_op(ctx, grad_losses, grad_lse):
    logits, labels, lse = ctx.saved_tensors
    # .contiguous(): the kernel reads grad_losses[row] densely, and a grad from .sum() or a
    # mask multiply arrives expanded (stride 0); copying N floats is nothing next to N * V.
    grad_logits = _backward_op(logits, labels, lse, grad_losses.contiguous(), ctx.ignore_index)
    return grad_logits, None, None


_forward_op.register_autograd(_backward_of_forward_op, setup_context=_setup_context)


def _cross_entropy_kernel(logits, labels, ignore_index):
    return _forward_op(logits, labels, ignore_index)[0]


def cross_entropy_reference(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Plain-PyTorch cross-entropy: fp32 per-row losses [N] of [N, V] logits, unreduced."""
    return F.cross_entropy(logits.float(), labels, reduction="none", ignore_index=ignore_index)


def cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Per-row fp32 losses [N] of logits [N, V] (bf16, fp16 or fp32) and int labels [N].

    Same values and gradient as `cross_entropy_reference`, without an fp32 copy of the logits.
    Nothing is checked on the device: a label outside [0, V) other than ignore_index gives a NaN
    loss and NaN gradient row where the reference raises.
    """
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(
            f"cross_entropy takes logits [N, V] and labels [N]; got logits {tuple(logits.shape)} "
            f"and labels {tuple(labels.shape)}: flatten them with .view(-1, V) and .reshape(-1)"
        )
    if not use_triton(logits):
        return cross_entropy_reference(logits, labels, ignore_index)
    return _cross_entropy_kernel(logits.contiguous(), labels.contiguous(), ignore_index)


def cross_entropy_forward(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward half alone, outside autograd: fp32 (losses, lse) [N] of logits [N, V].

    For callers that keep lse and run `cross_entropy_backward` themselves instead of keeping
    the logits (megatron.kernels.linear_cross_entropy). The kernel where `use_triton` says so,
    else the reference math (which, like `cross_entropy_reference`, raises on a bad label).
    """
    logits = logits.detach()
    if not use_triton(logits):
        losses = cross_entropy_reference(logits, labels, ignore_index)
        return losses, torch.logsumexp(logits.float(), dim=-1)
    return _forward_op(logits.contiguous(), labels.contiguous(), ignore_index)


def cross_entropy_backward(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    grad_losses: torch.Tensor,
    ignore_index: int = -100,
) -> torch.Tensor:
    """grad_logits [N, V] in the logits' dtype: (exp(logits - lse) - onehot(label)) * grad_losses,
    zero on ignore_index rows; the backward half to `cross_entropy_forward`."""
    logits = logits.detach()
    if use_triton(logits):
        return _backward_op(
            logits.contiguous(),
            labels.contiguous(),
            lse.contiguous(),
            grad_losses.contiguous(),
            ignore_index,
        )
    ignored = labels == ignore_index
    probs = torch.exp(logits.float() - lse[:, None])
    # An ignored row's label may be outside [0, V); its gradient is scaled to zero anyway.
    targets = labels.masked_fill(ignored, 0)[:, None]
    grad = probs.scatter_add(1, targets, probs.new_full(targets.shape, -1.0))
    scale = grad_losses.float().masked_fill(ignored, 0.0)
    return (grad * scale[:, None]).to(logits.dtype)


def _forward_spec(dtype: str) -> AotSpec:
    return AotSpec(
        kernel=_cross_entropy_forward_kernel,
        signature={
            "logits_ptr": f"*{dtype}",
            "labels_ptr": "*i64",
            "losses_ptr": "*fp32",
            "lse_ptr": "*fp32",
            "vocab_size": "i32",
            "ignore_index": "i32",
        },
        constexprs={"BLOCK_V": BLOCK_V},
    )


def _backward_spec(dtype: str) -> AotSpec:
    return AotSpec(
        kernel=_cross_entropy_backward_kernel,
        signature={
            "logits_ptr": f"*{dtype}",
            "labels_ptr": "*i64",
            "lse_ptr": "*fp32",
            "grad_losses_ptr": "*fp32",
            "grad_logits_ptr": f"*{dtype}",
            "vocab_size": "i32",
            "ignore_index": "i32",
        },
        constexprs={"BLOCK_V": BLOCK_V},
    )


AOT_SPECS = (
    [spec(dtype) for spec in (_forward_spec, _backward_spec) for dtype in ("bf16", "fp32")]
    if TRITON_AVAILABLE
    else []
)
