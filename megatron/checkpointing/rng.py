"""Random-number-generator state per rank: capture, gather, restore.

The saved list has one entry per rank of the saving group (the world by default), in rank
order, so with tensor parallelism entry ``tp_rank + tp_size * dp_rank``. The default generators
agree across the TP ranks of a replica; the tracker's streams differ per TP rank, and its
expert-parallel stream per expert-parallel rank too (megatron.tensor_parallel.random).
"""

from __future__ import annotations

import random
from typing import Any, Collection, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron.parallel import parallel_state
from megatron.tensor_parallel import EXPERT_PARALLEL_RNG, model_parallel_rng_tracker


def data_parallel_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in the data-parallel `group` (the world by default); 0 when alone."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def capture_rng_state() -> Dict[str, Any]:
    """This process's python, numpy, torch CPU and (when present) CUDA generator states."""
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": model_parallel_rng_tracker().get_states(),
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "expert_model_parallel_size": parallel_state.get_expert_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
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


def saved_rng_state_index(
    rng_states: List[Dict[str, Any]], rank: int
) -> Tuple[int, Tuple[str, ...]]:
    """Which saved entry this process (``rank`` in the saving group) resumes, and the tracker
    streams that do not carry over from it and stay as seeded (empty in the saved layout).

    At the saved TP size a rank takes its own entry. At another, it takes TP rank 0's entry of
    its data-parallel replica: the default generators are the same on every TP rank, while the
    per-TP-rank tracker streams do not translate between TP sizes and none carries over. At
    another expert-parallel size (same TP size) only the expert-parallel stream, seeded by the
    expert-parallel rank, stays as seeded. At another pipeline size every stage takes the first
    stage's entry.
    """
    saved = rng_states[0] if rng_states else {}
    saved_tensor_size = saved.get("tensor_model_parallel_size", 1)
    if saved_tensor_size != parallel_state.get_tensor_model_parallel_world_size():
        every_stream = tuple(saved.get("rng_tracker_states") or ())
        return saved_tensor_size * parallel_state.get_data_parallel_rank(), every_stream
    if saved.get("pipeline_model_parallel_size", 1) != (
        parallel_state.get_pipeline_model_parallel_world_size()
    ):
        # Stages do not translate between pipeline sizes: every stage resumes the first
        # stage's entry of its replica and TP rank (pipeline stages are the slowest-varying
        # rank coordinate, so that entry's index is the same in both layouts).
        tensor_size = parallel_state.get_tensor_model_parallel_world_size()
        return (
            tensor_size * parallel_state.get_data_parallel_rank()
            + parallel_state.get_tensor_model_parallel_rank(),
            (),
        )
    saved_expert_size = saved.get("expert_model_parallel_size", 1)
    if saved_expert_size != parallel_state.get_expert_model_parallel_world_size():
        return rank, (EXPERT_PARALLEL_RNG,)
    return rank, ()


def missing_rng_state(rng_states: List[Dict[str, Any]], rank: int, path: str) -> Optional[str]:
    """Why `rng_states`, read from checkpoint `path`, cannot restore saved entry `rank`
    (`saved_rng_state_index`'s); None when it can."""
    if rank < len(rng_states):
        return None
    return (
        f"{path} holds RNG states for {len(rng_states)} data-parallel ranks, none for rank "
        f"{rank}; resuming on more data-parallel ranks than were saved needs --no-load-rng"
    )


def restore_rng_state(
    rng_states: List[Dict[str, Any]], rank: int, path: str, keep_seeded: Collection[str] = ()
) -> None:
    """Put this process's generators back to `rng_states[rank]`, read from checkpoint `path`,
    and the tracker's streams when they were saved, except those named in `keep_seeded`.

    A checkpoint saved on a GPU restores on CPU without its CUDA state; one saved on CPU leaves
    the CUDA generator as seeded.
    """
    refusal = missing_rng_state(rng_states, rank, path)
    if refusal is not None:
        raise ValueError(refusal)
    state = rng_states[rank]
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tracker_states = state.get("rng_tracker_states")
    # The tracker's streams are generator states of the device type it was saved on (CUDA
    # when the saving run had a GPU): they only fit a tracker of the same type.
    same_device_type = ("cuda_rng_state" in state) == torch.cuda.is_available()
    if tracker_states and same_device_type:
        tracker = model_parallel_rng_tracker()
        restored = {
            name: tracker_states[name] for name in tracker_states if name not in keep_seeded
        }
        tracker.set_states({**tracker.get_states(), **restored})
