"""Tests for bench.kernels, the experimental kernels only the benchmarks use."""
