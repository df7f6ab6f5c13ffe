"""Tests for megatron.memory_plan and tools/estimate_memory.py."""
