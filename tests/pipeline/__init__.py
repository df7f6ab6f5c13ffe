"""Tests for megatron.pipeline: the schedules and pipeline-parallel runs end to end."""
