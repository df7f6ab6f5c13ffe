"""Tests for megatron.tensor_parallel: its layers, mappings, cross-entropy and RNG tracker."""
