"""Test markers shared across the suites."""

import pytest
import torch


def gpu(test):
    """Marks a test that needs a CUDA or ROCm GPU; it is skipped cleanly without one."""
    needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
    return pytest.mark.gpu(needs_gpu(test))
