"""Two gloo ranks: each saves its own RNG state into the one file rank 0 writes, and gets it back."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron.checkpointing import checkpoint_file, load_checkpoint, save_checkpoint
from tests.checkpointing.helpers import (
    build,
    checkpoint_config,
    draw_from_every_generator,
    seed_every_generator,
)


def _worker(rank: int, directory: str, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
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
    finally:
        dist.destroy_process_group()


def test_each_rank_resumes_its_own_rng_stream(tmp_path):
    directory = str(tmp_path / "checkpoints")
    # fork skips re-importing torch in the children, which is most of this test's time; a
    # process that has initialized CUDA (an earlier GPU test) cannot fork, so it spawns.
    torch.multiprocessing.start_processes(
        _worker,
        args=(directory, str(tmp_path / "init")),
        nprocs=2,
        join=True,
        start_method="spawn" if torch.cuda.is_initialized() else "fork",
    )
    assert sorted(os.listdir(directory)) == ["iter_0000005", "latest_checkpointed_iteration.txt"]
