"""Fixtures for the MoE tests: the layers' tests here and the kernels' in tests/moe/kernels/."""

import os

import pytest


@pytest.fixture
def triton_kernels(monkeypatch):
    """Run the public ops through their Triton kernels (the interpreter on CPU)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("these kernel-vs-reference tests use CPU tensors and Triton's CPU interpreter")
    monkeypatch.setenv("MOE_KERNELS", "triton")
