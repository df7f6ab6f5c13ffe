"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import pytest

from megatron.kernels import cross_entropy


@pytest.fixture
def launches(monkeypatch):
    """Counts launches of the cross-entropy kernels, proving the interpreter (not the reference)
    ran them; used by the cross-entropy and the fused linear cross-entropy tests."""
    counts = {"forward": 0, "backward": 0}
    kernels = {
        "forward": cross_entropy._cross_entropy_forward_kernel,
        "backward": cross_entropy._cross_entropy_backward_kernel,
    }
    for name, kernel in kernels.items():
        original = kernel.run

        def run(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", run)
    return counts
