"""Tests for megatron.composition and the run gpt_pretraining composes through it (GPT_RUN)."""
