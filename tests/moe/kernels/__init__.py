"""Tests for moe.kernels."""
