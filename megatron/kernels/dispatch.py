"""When the public ops run their Triton kernels and when their pure-PyTorch references.

Kernels run on GPU tensors when Triton is importable. The mode can force a choice: "triton"
forces the kernels (tests do this with `TRITON_INTERPRET=1` to run them on the CPU through
Triton's interpreter), "reference" forces the references everywhere. It is read once: a run
takes it from the `MEGATRON_KERNELS` environment variable (its earlier name `MOE_KERNELS` is
read when it is unset) when its config is built (shown as
`kernels` in the arguments block) and sets it for its duration (`kernel_mode_set`); other
callers get the environment's value at their first op.

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

import contextlib
import importlib.util
import os
from typing import Iterator, Optional

import torch

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None

KERNEL_MODES = ("auto", "triton", "reference")

# The mode every op reads; None until the first op or `kernel_mode_set`.
_mode: Optional[str] = None


# The variable, and the name it had while it seemed to govern the MoE kernels alone (it
# governs every kernel): read when the variable is unset, so that existing scripts keep their
# choice.
KERNELS_VARIABLE = "MEGATRON_KERNELS"
EARLIER_KERNELS_VARIABLE = "MOE_KERNELS"


def kernel_mode_from_environment() -> str:
    """MEGATRON_KERNELS (else MOE_KERNELS): "auto" (default), "triton" or "reference";
    ValueError naming any other."""
    name = next(
        (name for name in (KERNELS_VARIABLE, EARLIER_KERNELS_VARIABLE) if name in os.environ),
        None,
    )
    mode = os.environ[name] if name else "auto"
    if mode not in KERNEL_MODES:
        raise ValueError(
            f"{name}={mode!r} is not one of {', '.join(KERNEL_MODES)}; unset it (auto: "
            "Triton kernels on GPUs) or choose one of them"
        )
    return mode


def kernel_mode() -> str:
    """The mode in force: the one set by `kernel_mode_set`, else the environment's."""
    global _mode
    if _mode is None:
        _mode = kernel_mode_from_environment()
    return _mode


@contextlib.contextmanager
def kernel_mode_set(mode: str) -> Iterator[None]:
    """Every op within runs in `mode`; the previous mode returns after."""
    global _mode
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernel mode {mode!r} is not one of {', '.join(KERNEL_MODES)}")
    previous, _mode = _mode, mode
    try:
        yield
    finally:
        _mode = previous


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the op should run its Triton kernel for these tensors."""
    mode = kernel_mode()
    if mode == "reference" or not TRITON_AVAILABLE:
        return False
    if mode == "triton":
        return True
    return all(tensor.is_cuda for tensor in tensors)
