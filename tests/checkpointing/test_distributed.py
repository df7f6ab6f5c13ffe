"""Two gloo ranks: each saves its own RNG state into the one file rank 0 writes, and gets it back."""

from __future__ import annotations

import os

import torch

from megatron.checkpointing import checkpoint_file, load_checkpoint, save_checkpoint
from tests.checkpointing.helpers import (
    build,
    checkpoint_config,
    draw_from_every_generator,
    seed_every_generator,
)
from tests.launch import run_distributed


def _worker(rank: int, world_size: int, directory: str) -> None:
    model, optimizer, scheduler = build()
    seed_every_generator(100 + rank)
    path = save_checkpoint(checkpoint_config(directory), 5, model, optimizer, scheduler)
    assert (path is not None) == (rank == 0)
    # Every rank saw the complete checkpoint when save_checkpoint returned.
    assert os.path.isfile(checkpoint_file(directory, 5))
    expected = draw_from_every_generator()
    seed_every_generator(0)
    loaded = load_checkpoint(checkpoint_config(directory), model, optimizer, scheduler)
    assert loaded.iteration == 5
    assert draw_from_every_generator() == expected, f"rank {rank} got another rank's RNG"
    state = torch.load(checkpoint_file(directory, 5), weights_only=False)
    states = state["rng_state"]
    assert len(states) == 2
    assert not torch.equal(states[0]["torch_rng_state"], states[1]["torch_rng_state"])


def test_each_rank_resumes_its_own_rng_stream(tmp_path):
    directory = str(tmp_path / "checkpoints")
    run_distributed(_worker, 2, directory)
    assert sorted(os.listdir(directory)) == ["iter_0000005", "latest_checkpointed_iteration.txt"]
