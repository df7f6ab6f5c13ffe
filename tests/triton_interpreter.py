"""Running Triton kernels on the CPU through Triton's interpreter, for the kernel-vs-reference tests.

`enable()` must run before anything imports triton: `triton.jit` reads TRITON_INTERPRET when a
kernel is decorated. tests/conftest.py calls it at session start on machines without a GPU.
"""

from __future__ import annotations

import importlib.util
import os


def enable() -> bool:
    """Set TRITON_INTERPRET=1 and patch the interpreter's known bugs; False without triton."""
    if importlib.util.find_spec("triton") is None:
        return False
    os.environ.setdefault("TRITON_INTERPRET", "1")
    _patch_interpreter_bugs()
    return True


def _patch_interpreter_bugs() -> None:
    """Work around three bugs of Triton 3.6's CPU interpreter; compiled kernels have none.

    - A scalar tensor (a loaded value, a scalar argument) used as a `range` bound is turned into
      an int by int() on a 1-element array, which numpy >= 2.4 refuses (triton-lang/triton#9171).
    - tl.dot multiplies bf16 operands as their raw uint16 bits (bf16 is stored as uint16 there).
    - `.to(tl.bfloat16)` on fp32 truncates the mantissa; GPUs round to nearest even, so kernels
      would look up to twice as inexact on the CPU as they are.
    """
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_moe_bugs_patched", False):
        return
    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_with_scalar_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    create_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot_of_bf16_values(self, a, b, acc, input_precision, max_num_imprecise_acc):
        a, b = (
            self.cast_impl(operand, tl.float32) if operand.dtype == tl.bfloat16 else operand
            for operand in (a, b)
        )
        return create_dot(self, a, b, acc, input_precision, max_num_imprecise_acc)

    cast = interpreter.InterpreterBuilder.cast_impl

    def cast_rounding_to_nearest_even(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            values = np.asarray(src.data, dtype=np.float32)
            rounded = torch.from_numpy(values.reshape(-1).copy()).to(torch.bfloat16)
            bits = rounded.view(torch.int16).numpy().view(np.uint16).reshape(values.shape)
            return interpreter.TensorHandle(bits, dst_type.scalar)
        return cast(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_rounding_to_nearest_even
    interpreter._patch_lang_tensor = patch_tensor_with_scalar_index
    interpreter.InterpreterBuilder.create_dot = create_dot_of_bf16_values
    interpreter._moe_bugs_patched = True
