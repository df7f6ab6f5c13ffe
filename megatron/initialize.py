"""Process start-up: torch.distributed from torchrun's environment, device choice, the model-
parallel process groups, seeds, deterministic mode."""

from __future__ import annotations

import contextlib
import os
import random
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Optional, Tuple, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from megatron.console import print_line
from megatron.parallel import parallel_state
from megatron.parallel.progress_board import ProgressBoard
from megatron.tensor_parallel import model_parallel_manual_seed

T = TypeVar("T")


@dataclass(frozen=True)
class DistributedContext:
    """Where this process sits: its rank among `world_size` and the device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None
    # Where each rank is, for the message when a collective times out (multi-process runs).
    progress: Optional[ProgressBoard] = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0


def world_size_from_environment() -> int:
    """WORLD_SIZE as torchrun sets it (1 when started as a plain python process)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def compute_device() -> torch.device:
    """The device this process computes on: its local rank's GPU, or the CPU without one."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def initialize_distributed(
    requested_backend: str = "nccl", timeout_minutes: float = 10.0
) -> DistributedContext:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, ...).

    On GPUs the requested backend (NCCL, which is RCCL on ROCm builds) is used; without a GPU
    gloo is the only choice, whatever was requested. A single process without torchrun runs
    without a process group. A collective that waits longer than `timeout_minutes`
    (--distributed-timeout-minutes) raises.
    """
    world_size = world_size_from_environment()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = compute_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = requested_backend
    else:
        backend = "gloo"
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        return DistributedContext(0, 1, 0, device, None)
    timeout = timedelta(minutes=timeout_minutes)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            world_size=world_size,
            rank=rank,
            timeout=timeout,
            store=_restart_store(world_size, timeout),
        )
    progress = ProgressBoard.of_default_group(timeout)
    return DistributedContext(
        dist.get_rank(), dist.get_world_size(), local_rank, device, backend, progress
    )


def _restart_store(world_size: int, timeout: timedelta) -> Optional[dist.Store]:
    """The store the process groups meet in, under torchrun's restarts (--max-restarts).

    torchrun shares its own TCPStore with the workers (TORCHELASTIC_USE_AGENT_STORE) and keeps
    it across restarts, and torch prefixes nothing per attempt: the workers of a restarted
    attempt read the addresses the dead attempt's workers left there, and connecting to them
    fails or hangs (pytorch/pytorch#135712). Each attempt gets its own key prefix here, from
    TORCHELASTIC_RESTART_COUNT, which all workers of one node share. None (torch's own store)
    otherwise."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    store = dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        world_size=world_size,
        is_master=False,
        timeout=timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"megatron/attempt_{attempt}", store)


def initialize_model_parallel(
    tensor_model_parallel_size: int,
    expert_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    timeout_minutes: Optional[float] = None,
) -> None:
    """Create the tensor/pipeline/data/expert-parallel process groups
    (`megatron.parallel.parallel_state`) once the default process group exists; groups left by an
    earlier run in this process are replaced."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        timeout=None if timeout_minutes is None else timedelta(minutes=timeout_minutes),
    )


@contextlib.contextmanager
def deterministic_mode(enabled: bool) -> Iterator[None]:
    """--deterministic-mode (Megatron's flag) around a run; nothing when not `enabled`.

    On GPUs a run is otherwise not repeatable bit for bit: on an H100 two compiled runs of the
    same flags part in the fifth or sixth digit of the loss after 5 to 11 iterations, as some
    kernels add in whatever order their threads arrive (docs/training.md).

    This turns on torch's deterministic algorithms (Inductor then generates deterministic
    kernels too). Unless already set, it also sets the two environment variables they rely on:
    - CUBLAS_WORKSPACE_CONFIG, cuBLAS's workspace, read when the first handle is made;
    - NCCL_ALGO, one NCCL algorithm whatever the message size, read when a communicator is made.

    So enter it before any GPU work. The previous deterministic setting comes back on exit
    (tests run several runs in one process); the environment variables stay.
    """
    if not enabled:
        yield
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NCCL_ALGO", "Ring")
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def set_random_seed(seed: int) -> None:
    """Seed python, numpy and torch (CPU and every GPU) identically on every rank, and the
    tensor-parallel RNG tracker's per-TP-rank streams, as Megatron does.

    Call after `initialize_model_parallel`: the tracker's streams depend on the TP rank.
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    model_parallel_manual_seed(seed)


def is_global_rank_zero() -> bool:
    """Whether this process is global rank 0 (or runs without a process group)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def print_rank_0(message: str) -> None:
    """Print once per job, from global rank 0."""
    if is_global_rank_zero():
        print_line(message)


def first_from_any_rank(value: Optional[T]) -> Optional[Tuple[int, T]]:
    """(rank, value) of the lowest global rank whose `value` is not None, the same answer on
    every rank; None when no rank has one. A collective over the world (alone: this process's
    own). So that every rank acts on what one rank found, e.g. all refuse a checkpoint together
    instead of one stopping while the others go on into their next collective."""
    values = [value]
    if dist.is_initialized() and dist.get_world_size() > 1:
        values = [None] * dist.get_world_size()
        dist.all_gather_object(values, value)
    for rank, found in enumerate(values):
        if found is not None:
            return rank, found
    return None


def broadcast_from(value: Any, src: int = 0, group: Optional[dist.ProcessGroup] = None) -> Any:
    """Global rank `src`'s `value` (any picklable object) on every rank of `group` (the world
    by default): what one rank decided, for all to act on alike. A collective; `value` itself
    without a process group."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def barrier() -> None:
    """Wait for every rank (no-op without a process group)."""
    if dist.is_initialized():
        dist.barrier()
