"""Tests for bench/ code that the benchmarks share."""
