"""Tests for gpt_pretraining: the training run pretrain_gpt.py calls (gpt_pretraining.pretrain), end to end."""
