"""When the public ops run their Triton kernels and when their pure-PyTorch references.

Kernels run on GPU tensors when Triton is importable. `MOE_KERNELS=triton` forces the kernels
(tests do this with `TRITON_INTERPRET=1` to run them on the CPU through Triton's interpreter);
`MOE_KERNELS=reference` forces the references everywhere.

Triton is optional (the project installs it only on Linux x86_64). Every module of
megatron.kernels and moe.kernels therefore imports without it, by one pattern:

    from megatron.kernels.dispatch import TRITON_AVAILABLE, use_triton

    if TRITON_AVAILABLE:
        import triton
        import triton.language as tl

        from megatron.kernels.aot import AotSpec

    if TRITON_AVAILABLE:

        @triton.jit
        def _my_kernel(...): ...

    AOT_SPECS = [...] if TRITON_AVAILABLE else []

Launchers may name `triton` freely: they run only where `use_triton` said yes, which it never
does without Triton, so the op falls back to its reference. TRITON_AVAILABLE asks whether the
package is installed without importing it, so that tests can set TRITON_INTERPRET=1 before the
first `import triton` (tests/triton_interpreter.py).
"""

from __future__ import annotations

import importlib.util
import os

import torch

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def kernel_mode() -> str:
    """MOE_KERNELS: "auto" (default), "triton" or "reference"."""
    return os.environ.get("MOE_KERNELS", "auto")


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the op should run its Triton kernel for these tensors."""
    mode = kernel_mode()
    if mode == "reference" or not TRITON_AVAILABLE:
        return False
    if mode == "triton":
        return True
    return all(tensor.is_cuda for tensor in tensors)
