"""Tests for megatron.kernels."""
