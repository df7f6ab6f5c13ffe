"""Running Triton kernels on the CPU through Triton's interpreter, for the kernel-vs-reference tests.

`enable()` must run before anything imports triton: `triton.jit` reads TRITON_INTERPRET when a
kernel is decorated. tests/conftest.py calls it at session start on machines without a GPU.
"""

from __future__ import annotations

import importlib.util
import inspect
import os


def enable() -> bool:
    """Set TRITON_INTERPRET=1 and patch the interpreter's known bugs; False without triton."""
    if importlib.util.find_spec("triton") is None:
        return False
    os.environ.setdefault("TRITON_INTERPRET", "1")
    _patch_interpreter_bugs()
    return True


def _patch_interpreter_bugs() -> None:
    """Work around bugs of Triton's CPU interpreter (3.0 to 3.9); compiled kernels have none.

    - A scalar tensor (a loaded value, a scalar argument) used as a `range` bound is turned into
      an int by int() on a 1-element array, which numpy >= 2.4 refuses (triton-lang/triton#9171).
    - tl.dot multiplies bf16 operands as their raw uint16 bits (bf16 is stored as uint16 there).
    - `.to(tl.bfloat16)` on fp32 truncates the mantissa; GPUs round to nearest even, so kernels
      would look up to twice as inexact on the CPU as they are.
    - Triton 3.9 can hand a load or store an int32 mask (seen for `block_mask & scalar_mask`),
      which its interpreter then refuses ("mask has unsupported dtype"); a GPU reads it as bool.
    And three of Triton 3.0's (torch 2.4): its interpreter takes a `tl.constexpr` argument for a
    runtime one when the kernel's module postpones annotations (`from __future__ import
    annotations`, as ours do), since it then sees the string "tl.constexpr"; `kernel[grid]`
    bypasses `kernel.run`; and a scalar store whose scalar mask is False stores all the same
    (`tl.store` tests the mask with `not mask`, which the interpreter answers from its value).
    """
    import numpy as np
    import torch
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_moe_bugs_patched", False):
        return
    patch_tensor = interpreter._patch_lang_tensor

    def scalar_index(self):
        return int(self.handle.data.reshape(-1)[0])

    if len(inspect.signature(patch_tensor).parameters) == 2:  # (tensor, scope): Triton 3.6

        def patch_tensor_with_scalar_index(tensor, scope):
            patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", scalar_index)

    else:  # (tensor): Triton 3.0 (torch 2.4), which sets the attributes itself

        def patch_tensor_with_scalar_index(tensor):
            patch_tensor(tensor)
            tensor.__index__ = scalar_index

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

    masked_load = interpreter.InterpreterBuilder.create_masked_load
    masked_store = interpreter.InterpreterBuilder.create_masked_store

    def boolean(mask):
        return interpreter.TensorHandle(np.asarray(mask.data).astype(np.bool_), tl.int1)

    # Keyword arguments pass through: tensor-descriptor loads call with cache_policy=... .
    def masked_load_of_any_mask(self, ptrs, mask, *args, **kwargs):
        return masked_load(self, ptrs, boolean(mask), *args, **kwargs)

    def masked_store_of_any_mask(self, ptrs, value, mask, *args, **kwargs):
        return masked_store(self, ptrs, value, boolean(mask), *args, **kwargs)

    interpreter.InterpreterBuilder.create_masked_load = masked_load_of_any_mask
    interpreter.InterpreterBuilder.create_masked_store = masked_store_of_any_mask
    interpreter.InterpreterBuilder.cast_impl = cast_rounding_to_nearest_even
    interpreter._patch_lang_tensor = patch_tensor_with_scalar_index
    interpreter.InterpreterBuilder.create_dot = create_dot_of_bf16_values
    grid_executor_init = interpreter.GridExecutor.__init__

    def grid_executor_init_with_postponed_annotations(self, fn, arg_names, *args, **kwargs):
        grid_executor_init(self, fn, arg_names, *args, **kwargs)
        annotations = fn.__annotations__
        self.constexprs = [
            name for name in arg_names if "constexpr" in str(annotations.get(name, ""))
        ]

    def launch_through_run(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, **kwargs)

    def store_honouring_a_false_scalar_mask(
        ptr, val, mask, boundary_check, cache, eviction, builder
    ):
        if mask is None or ptr.type.is_block():
            return store_legacy(ptr, val, mask, boundary_check, cache, eviction, builder)
        val = semantic.cast(val, ptr.type.scalar.element_ty, builder)
        store = builder.create_masked_store(ptr.handle, val.handle, mask.handle, cache, eviction)
        return tl.tensor(store, tl.void)

    if triton.__version__.startswith("3.0."):
        from triton.language import semantic

        store_legacy = semantic._store_legacy
        semantic._store_legacy = store_honouring_a_false_scalar_mask
        interpreter.GridExecutor.__init__ = grid_executor_init_with_postponed_annotations
        # kernel[grid](...) through kernel.run, as compiled kernels and newer interpreters do,
        # so that the tests' launch counters (which wrap .run) see every launch.
        interpreter.InterpretedFunction.__getitem__ = launch_through_run
    interpreter._moe_bugs_patched = True
