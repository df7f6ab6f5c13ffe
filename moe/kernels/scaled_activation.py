"""The expert activation scaled by each row's router weight, as one op torch.compile keeps whole.

The dMoE's experts (Experts.forward_grouped) multiply each row's activations by the router's
weight for that row before the second projection:

    out[r, :] = act(h[r, :]) * scale[r]      (act: tanh-GELU or SiLU; the product in fp32)

Its backward needs, besides the input gradient, the scale's gradient: a sum over each row of
grad_out * act(h). Inductor fuses that into one reduction kernel, but one that runs well below
the copy rate, slower than ATen's plain GELU backward over the same bytes
(docs/benchmark-log.md). The kernels here do the same work reading each tensor once: the forward
is a 2-D elementwise tile; the backward walks each block of rows across its channels, writing
the input gradient as it goes and the scale's gradient at the end.

Rounding follows the eager code it replaces: the activation is rounded to the input dtype
before the fp32 product, and its gradient is rounded to the input dtype before the activation's
derivative multiplies it.

Rows past `valid` (a device scalar: the grouped products' last offset) are the expert-parallel
fixed-size blocks' padding (moe.exchange.fixed_blocks), which no product includes: the kernels
neither read nor write them, forward or backward, so padding costs no work here.

Like moe.kernels.token_rows these are `torch.library` custom ops with their own autograd; each
runs its Triton kernel where `use_triton` says so and its pure-PyTorch reference otherwise.
"""

# No `from __future__ import annotations`: torch.library.custom_op reads the ops' signatures from
# their annotations, and older torch (2.4) does not resolve string annotations.

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.kernels.dispatch import TRITON_AVAILABLE, use_triton

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from megatron.kernels.aot import AotSpec

ACTIVATIONS = ("gelu", "silu")  # gelu: the tanh approximation, as Experts uses
# Forward tile: 16 rows x 256 channels, as the row permutations use. Backward: 4 rows per
# program, walked across the channels 256 at a time (the fastest of the tiles
# `python -m bench.scaled_activation --sweep` tried, at every configuration's shape;
# docs/benchmark-log.md).
BLOCK_ROWS = 16
BLOCK_W = 256
BACKWARD_BLOCK_ROWS = 4


# --- references ----------------------------------------------------------------------------


def _activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "gelu":
        return F.gelu(h, approximate="tanh")
    return F.silu(h)


def scaled_activation_reference(
    h: torch.Tensor, scale: torch.Tensor, activation: str
) -> torch.Tensor:
    """act(h) rounded to h's dtype, times scale [rows] in fp32, rounded to h's dtype."""
    return (_activation(h, activation).float() * scale.float().unsqueeze(-1)).to(h.dtype)


def scaled_activation_backward_reference(
    grad_out: torch.Tensor, h: torch.Tensor, scale: torch.Tensor, activation: str
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(grad_h, grad_scale) of scaled_activation_reference, by the steps autograd takes
    through it (an op's implementation runs below autograd, so it cannot call autograd)."""
    grad_product = grad_out.float()
    grad_scale = (grad_product * _activation(h, activation).float()).sum(-1).to(scale.dtype)
    grad_value = (grad_product * scale.float().unsqueeze(-1)).to(h.dtype)
    if activation == "gelu":
        grad_h = torch.ops.aten.gelu_backward(grad_value, h, approximate="tanh")
    else:
        grad_h = torch.ops.aten.silu_backward(grad_value, h)
    return grad_h, grad_scale


# --- Triton kernels ------------------------------------------------------------------------

if TRITON_AVAILABLE:

    @triton.jit
    def _tanh(x):
        # 1 - 2 / (exp(2x) + 1): exp is in every backend's math library, tanh is not (portably).
        # Clamped where tanh is +-1 in fp32 anyway, so that exp never overflows.
        return 1.0 - 2.0 / (tl.exp(tl.minimum(2.0 * x, 40.0)) + 1.0)

    @triton.jit
    def _activation_and_derivative(h, ACTIVATION: tl.constexpr):
        """(act(h), act'(h)) in fp32; ACTIVATION 0: tanh-GELU, 1: SiLU."""
        if ACTIVATION == 0:
            beta = 0.7978845608028654  # sqrt(2 / pi)
            kappa = 0.044715
            inner_tanh = _tanh(beta * (h + kappa * h * h * h))
            value = 0.5 * h * (1.0 + inner_tanh)
            slope = 0.5 * (1.0 + inner_tanh) + 0.5 * h * (1.0 - inner_tanh * inner_tanh) * beta * (
                1.0 + 3.0 * kappa * h * h
            )
        else:
            sigmoid = 1.0 / (1.0 + tl.exp(tl.minimum(-h, 80.0)))
            value = h * sigmoid
            slope = sigmoid * (1.0 + h * (1.0 - sigmoid))
        return value, slope

    @triton.jit
    def _scaled_activation_kernel(
        h_ptr,
        scale_ptr,
        out_ptr,
        valid_ptr,
        num_rows,
        width,
        ACTIVATION: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        """out = round(round(act(h)) * scale[row]) on a tile of rows by channels, rows below
        valid only."""
        num_rows = tl.minimum(num_rows, tl.load(valid_ptr))
        first = tl.program_id(0) * BLOCK_ROWS
        if first >= num_rows:
            return
        rows = first + tl.arange(0, BLOCK_ROWS)
        cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        row_mask = rows < num_rows
        mask = row_mask[:, None] & (cols[None, :] < width)
        offsets = rows.to(tl.int64)[:, None] * width + cols[None, :]
        h = tl.load(h_ptr + offsets, mask=mask, other=0).to(tl.float32)
        scale = tl.load(scale_ptr + rows, mask=row_mask, other=0).to(tl.float32)
        value, _ = _activation_and_derivative(h, ACTIVATION)
        value = value.to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(
            out_ptr + offsets, (value * scale[:, None]).to(out_ptr.dtype.element_ty), mask=mask
        )

    @triton.jit
    def _scaled_activation_backward_kernel(
        grad_out_ptr,
        h_ptr,
        scale_ptr,
        grad_h_ptr,
        grad_scale_ptr,
        valid_ptr,
        num_rows,
        width,
        ACTIVATION: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        """grad_h = act'(h) * round(grad_out * scale[row]); grad_scale[row] = sum over the row
        of grad_out * round(act(h)), in fp32, over this program's rows below valid."""
        num_rows = tl.minimum(num_rows, tl.load(valid_ptr))
        first = tl.program_id(0) * BLOCK_ROWS
        if first >= num_rows:
            return
        rows = first + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < num_rows
        row_starts = rows.to(tl.int64)[:, None] * width
        scale = tl.load(scale_ptr + rows, mask=row_mask, other=0).to(tl.float32)
        scale_grad = tl.zeros([BLOCK_ROWS, BLOCK_W], dtype=tl.float32)
        for start in range(0, width, BLOCK_W):
            cols = start + tl.arange(0, BLOCK_W)
            mask = row_mask[:, None] & (cols[None, :] < width)
            offsets = row_starts + cols[None, :]
            grad_out = tl.load(grad_out_ptr + offsets, mask=mask, other=0).to(tl.float32)
            h = tl.load(h_ptr + offsets, mask=mask, other=0).to(tl.float32)
            value, slope = _activation_and_derivative(h, ACTIVATION)
            scale_grad += grad_out * value.to(h_ptr.dtype.element_ty).to(tl.float32)
            grad_value = (grad_out * scale[:, None]).to(h_ptr.dtype.element_ty).to(tl.float32)
            grad_h = (grad_value * slope).to(grad_h_ptr.dtype.element_ty)
            tl.store(grad_h_ptr + offsets, grad_h, mask=mask)
        tl.store(grad_scale_ptr + rows, tl.sum(scale_grad, axis=1), mask=row_mask)


def _activation_code(activation: str) -> int:
    return ACTIVATIONS.index(activation)


def _block_w(width: int, block_w: int) -> int:
    return min(block_w, triton.next_power_of_2(max(width, 16)))


def _all_rows(h: torch.Tensor) -> torch.Tensor:
    return torch.full((1,), h.shape[0], dtype=torch.int32, device=h.device)


def _scaled_activation_triton(
    h, scale, activation, valid=None, block_rows=BLOCK_ROWS, block_w=BLOCK_W, out=None
):
    """The forward kernel's launch (`valid` None: every row); `out` (tests: one prefilled to
    show which rows are never written) defaults to an empty tensor."""
    h, scale = h.contiguous(), scale.contiguous()
    valid = _all_rows(h) if valid is None else valid
    out = torch.empty_like(h) if out is None else out
    if out.numel() == 0:
        return out
    rows, width = h.shape
    block_w = _block_w(width, block_w)
    grid = (triton.cdiv(rows, block_rows), triton.cdiv(width, block_w))
    _scaled_activation_kernel[grid](
        h, scale, out, valid, rows, width, ACTIVATION=_activation_code(activation),
        BLOCK_ROWS=block_rows, BLOCK_W=block_w,
    )  # fmt: skip
    return out


def _scaled_activation_backward_triton(
    grad_out, h, scale, activation, valid=None, block_rows=BACKWARD_BLOCK_ROWS, block_w=BLOCK_W,
    outputs=None,
):  # fmt: skip
    """The backward kernel's launch; `outputs` (grad_h, fp32 grad_scale), tests' prefilled
    ones, default to empty tensors."""
    grad_out, h, scale = grad_out.contiguous(), h.contiguous(), scale.contiguous()
    valid = _all_rows(h) if valid is None else valid
    # The row sums in fp32, as autograd accumulates them; cast to the scale's dtype after.
    grad_h, grad_scale = outputs or (
        torch.empty_like(h),
        torch.empty(scale.shape, device=scale.device, dtype=torch.float32),
    )
    if h.numel() == 0:
        return grad_h, grad_scale.zero_().to(scale.dtype)
    rows, width = h.shape
    grid = (triton.cdiv(rows, block_rows),)
    _scaled_activation_backward_kernel[grid](
        grad_out, h, scale, grad_h, grad_scale, valid, rows, width,
        ACTIVATION=_activation_code(activation), BLOCK_ROWS=block_rows,
        BLOCK_W=_block_w(width, block_w),
    )  # fmt: skip
    return grad_h, grad_scale.to(scale.dtype)


# --- the ops -------------------------------------------------------------------------------


@torch.library.custom_op("moe::scaled_activation", mutates_args=())
def _scaled_activation_op(
    h: torch.Tensor, scale: torch.Tensor, activation: str, valid: torch.Tensor
) -> torch.Tensor:
    if use_triton(h, scale):
        return _scaled_activation_triton(h, scale, activation, valid)
    return scaled_activation_reference(h, scale, activation)


@_scaled_activation_op.register_fake
def _(h, scale, activation, valid):
    return torch.empty_like(h)


@torch.library.custom_op("moe::scaled_activation_backward", mutates_args=())
def _scaled_activation_backward_op(
    grad_out: torch.Tensor, h: torch.Tensor, scale: torch.Tensor, activation: str,
    valid: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    if use_triton(grad_out, h, scale):
        return _scaled_activation_backward_triton(grad_out, h, scale, activation, valid)
    return scaled_activation_backward_reference(grad_out, h, scale, activation)


@_scaled_activation_backward_op.register_fake
def _(grad_out, h, scale, activation, valid):
    return torch.empty_like(h), torch.empty_like(scale)


def _setup(ctx, inputs, output):
    h, scale, activation, valid = inputs
    ctx.activation = activation
    ctx.save_for_backward(h, scale, valid)


def _backward(ctx, grad_out):
    h, scale, valid = ctx.saved_tensors
    grad_h, grad_scale = _scaled_activation_backward_op(grad_out, h, scale, ctx.activation, valid)
    return grad_h, grad_scale, None, None


_scaled_activation_op.register_autograd(_backward, setup_context=_setup)


def scaled_activation(
    h: torch.Tensor, scale: torch.Tensor, activation: str, valid: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """act(h) * scale[:, None] for h [rows, width] and scale [rows]; `activation` one of
    ACTIVATIONS ("gelu": the tanh approximation). See the module's notes on rounding.

    `valid`: int32 [1] on h's device, the rows that count (the first ones); the kernels leave
    the others unwritten, forward and backward (None: every row)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if h.dim() != 2 or scale.shape != h.shape[:1]:
        raise ValueError(
            f"scaled_activation takes h [rows, width] and scale [rows], got {tuple(h.shape)} "
            f"and {tuple(scale.shape)}"
        )
    return _scaled_activation_op(h, scale, activation, _all_rows(h) if valid is None else valid)


def _aot_specs(dtype: str) -> list:
    common = {"scale_ptr": "*fp32", "valid_ptr": "*i32", "num_rows": "i32", "width": "i32"}
    return [
        AotSpec(
            kernel=_scaled_activation_kernel,
            signature={"h_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", **common},
            constexprs={"ACTIVATION": activation, "BLOCK_ROWS": BLOCK_ROWS, "BLOCK_W": BLOCK_W},
        )
        for activation in range(len(ACTIVATIONS))
    ] + [
        AotSpec(
            kernel=_scaled_activation_backward_kernel,
            signature={
                "grad_out_ptr": f"*{dtype}", "h_ptr": f"*{dtype}", "grad_h_ptr": f"*{dtype}",
                "grad_scale_ptr": "*fp32", **common,
            },
            constexprs={
                "ACTIVATION": activation, "BLOCK_ROWS": BACKWARD_BLOCK_ROWS, "BLOCK_W": BLOCK_W,
            },
        )
        for activation in range(len(ACTIVATIONS))
    ]  # fmt: skip


# What `python tools/compile_kernels.py` builds: both activations, forward and backward, for bf16 and
# fp32 rows.
AOT_SPECS = (
    [spec for dtype in ("bf16", "fp32") for spec in _aot_specs(dtype)] if TRITON_AVAILABLE else []
)
