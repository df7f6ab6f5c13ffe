"""Fixtures for the benchmark kernels' tests (the same pattern as tests/moe/conftest.py)."""

import os

import pytest


@pytest.fixture
def triton_kernels(monkeypatch):
    """Run the kernels through Triton's interpreter on CPU tensors."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("these kernel-vs-reference tests use CPU tensors and Triton's CPU interpreter")
    monkeypatch.setenv("MOE_KERNELS", "triton")
