"""Tests for megatron.training: the loop's logging, profiling, divergence checks and determinism, and how a run survives a killed or hung rank."""
