"""Random-number-generator state per data-parallel rank: capture, gather, restore."""

from __future__ import annotations

import random
from typing import Any, Dict, List

import numpy as np
import torch
import torch.distributed as dist


def data_parallel_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in the data-parallel `group` (the world by default); 0 when alone."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def capture_rng_state() -> Dict[str, Any]:
    """This process's python, numpy, torch CPU and (when present) CUDA generator states."""
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        # Tensor-parallel RNG tracker states; empty until tensor parallelism adds its tracker.
        "rng_tracker_states": {},
    }
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def gather_rng_states(group: dist.ProcessGroup | None = None) -> List[Dict[str, Any]]:
    """Every data-parallel rank's `capture_rng_state()`, indexed by rank; a collective."""
    state = capture_rng_state()
    if not dist.is_initialized():
        return [state]
    states: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(states, state, group=group)
    return states


def restore_rng_state(rng_states: List[Dict[str, Any]], rank: int, path: str) -> None:
    """Put this process's generators back to `rng_states[rank]`, read from checkpoint `path`.

    A checkpoint saved on a GPU restores on CPU without its CUDA state; one saved on CPU leaves
    the CUDA generator as seeded.
    """
    if rank >= len(rng_states):
        raise ValueError(
            f"{path} holds RNG states for {len(rng_states)} data-parallel ranks, but this is "
            f"rank {rank}; resuming on more data-parallel ranks than were saved needs "
            "--no-load-rng"
        )
    state = rng_states[rank]
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
