"""A tiny GPT, its optimizer and scheduler, and helpers shared by the checkpointing tests."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import torch

from megatron.config import CheckpointConfig, ModelConfig
from megatron.model import GPTModel

VOCAB = 64
SEQ_LENGTH = 8


class StepScheduler:
    """Stands in for the LR scheduler: halves the LR every `period` steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, period: int = 2) -> None:
        self.optimizer = optimizer
        self.period = period
        self.num_steps = 0

    def step(self) -> None:
        self.num_steps += 1
        if self.num_steps % self.period == 0:
            for group in self.optimizer.param_groups:
                group["lr"] *= 0.5

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "period": self.period}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = state["num_steps"]
        self.period = state["period"]


def build(seed: int = 0, num_layers: int = 2):
    """A tiny GPT (with dropout, so training draws from the torch RNG), AdamW and a scheduler."""
    torch.manual_seed(seed)
    config = ModelConfig(
        num_layers=num_layers,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        seq_length=SEQ_LENGTH,
        max_position_embeddings=SEQ_LENGTH,
        padded_vocab_size=VOCAB,
    )
    model = GPTModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, StepScheduler(optimizer)


def train(model, optimizer, scheduler, steps: int) -> None:
    """Steps whose batches come from the torch RNG, so they depend on the RNG state too."""
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (2, SEQ_LENGTH + 1))
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()


def checkpoint_config(directory, **flags) -> CheckpointConfig:
    """Save to and load from `directory`; the torch format (one file these tests inspect)
    unless `ckpt_format` says otherwise."""
    flags.setdefault("ckpt_format", "torch")
    return replace(CheckpointConfig(save=str(directory), load=str(directory)), **flags)


def draw_from_every_generator() -> tuple:
    """Next values of python random, numpy and torch CPU, for comparing RNG streams."""
    return random.random(), float(np.random.rand()), torch.rand(4).tolist()


def seed_every_generator(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def assert_state_dicts_equal(left: dict, right: dict) -> None:
    assert left.keys() == right.keys()
    for key in left:
        assert torch.equal(left[key], right[key]), key


def assert_optimizer_states_equal(left: dict, right: dict) -> None:
    assert left["param_groups"] == right["param_groups"]
    assert left["state"].keys() == right["state"].keys()
    for index, state in left["state"].items():
        for name, value in state.items():
            assert torch.equal(value, right["state"][index][name]), (index, name)
