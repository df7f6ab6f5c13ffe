"""Tests for megatron.parallel: process groups, parallelize's steps and the layouts they give."""
