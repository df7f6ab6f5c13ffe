"""Test markers shared across the suites."""

import pytest
import torch

from moe.kernels.grouped_gemm import torch_has_grouped_mm


def gpu(test):
    """Marks a test that needs a CUDA or ROCm GPU; it is skipped cleanly without one."""
    needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
    return pytest.mark.gpu(needs_gpu(test))


# torch._grouped_mm, the grouped GEMM a run on Hopper compiles, exists from torch 2.8 on.
needs_torch_grouped_mm = pytest.mark.skipif(
    not torch_has_grouped_mm(),
    reason=f"torch {torch.__version__} has no torch._grouped_mm (2.8 and newer)",
)
