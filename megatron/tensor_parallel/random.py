"""Random streams for tensor parallelism: which dropout masks agree across ranks and which differ.

Two kinds of randomness coexist in a tensor-parallel model:

- the replicated residual stream (dropout after attention/MLP, embedding dropout) must draw
  the same mask on every tensor-parallel rank, or the replicas drift apart: it uses the default
  generator, seeded identically on all TP ranks;
- a sharded region (dropout on attention probabilities, whose heads are split over TP ranks)
  must draw independent masks per shard, or every shard repeats the same pattern: it runs
  inside ``model_parallel_rng_tracker().fork()``, which swaps in a per-TP-rank stream.

Seeds follow Megatron-LM's ``model_parallel_cuda_manual_seed``: default generator ``seed``,
``model-parallel-rng`` ``seed + 2718 + tp_rank``, ``expert-parallel-rng``
``seed + 1024 + 100 * ep_rank + tp_rank``. Megatron's training loop passes
``seed + 100 * pipeline_rank`` so that pipeline stages draw differently; that offset is the
caller's choice, not this module's.

The tracker swaps the default generator of one device type: "cuda" (the current device) when a
GPU is available, else "cpu", so the same code drives dropout on CPU tests and on GPUs.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch
import torch.utils.checkpoint

from megatron.parallel import parallel_state

MODEL_PARALLEL_RNG = "model-parallel-rng"
EXPERT_PARALLEL_RNG = "expert-parallel-rng"

# Megatron-LM's offsets, kept so that a run seeded the same way draws the same streams.
_MODEL_PARALLEL_SEED_OFFSET = 2718
_EXPERT_PARALLEL_SEED_OFFSET = 1024


def _default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _get_rng_state(device_type: str) -> torch.Tensor:
    if device_type == "cuda":
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states that `fork` swaps in for the device's default generator."""

    def __init__(self, device_type: Optional[str] = None) -> None:
        self.device_type = device_type or _default_device_type()
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()

    def reset(self, device_type: Optional[str] = None) -> None:
        """Forget every stream (and switch device type when one is given)."""
        if device_type is not None:
            self.device_type = device_type
        self._states = {}
        self._seeds = set()

    def add(self, name: str, seed: int) -> None:
        """Start stream ``name`` from ``seed``; a name or seed used twice is an error because
        two streams with one seed would draw correlated masks."""
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists; reset() the tracker first")
        if seed in self._seeds:
            raise ValueError(f"seed {seed} already starts another RNG stream; use distinct seeds")
        generator = torch.Generator(device=self.device_type)
        generator.manual_seed(seed)
        self._states[name] = generator.get_state()
        self._seeds.add(seed)

    def get_states(self) -> dict[str, torch.Tensor]:
        """Copies of every stream's state, for a checkpoint (the default generator is separate)."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Restore streams saved by `get_states`."""
        self._states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default generator resumes after it."""
        if name not in self._states:
            raise KeyError(
                f"RNG stream {name!r} was never added; call model_parallel_manual_seed(seed) "
                f"(or add(name, seed)) first"
            )
        default_state = _get_rng_state(self.device_type)
        _set_rng_state(self._states[name], self.device_type)
        try:
            yield
        finally:
            self._states[name] = _get_rng_state(self.device_type)
            _set_rng_state(default_state, self.device_type)


_TRACKER = RNGStatesTracker()


def model_parallel_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker that tensor-parallel layers fork for sharded dropout."""
    return _TRACKER


def model_parallel_manual_seed(seed: int, device_type: Optional[str] = None) -> None:
    """Seed the default generators with ``seed`` and the tracker's per-rank streams.

    Call after `parallel_state.initialize_model_parallel` (the streams depend on this rank's
    tensor and expert parallel ranks). ``torch.manual_seed`` seeds the CPU and every GPU
    generator, which is Megatron's ``_set_random_seed`` plus ``torch.cuda.manual_seed`` in one.
    """
    tensor_rank = parallel_state.get_tensor_model_parallel_rank()
    expert_rank = parallel_state.get_expert_model_parallel_rank()
    torch.manual_seed(seed)
    _TRACKER.reset(device_type or _default_device_type())
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _MODEL_PARALLEL_SEED_OFFSET + tensor_rank)
    _TRACKER.add(
        EXPERT_PARALLEL_RNG, seed + _EXPERT_PARALLEL_SEED_OFFSET + 100 * expert_rank + tensor_rank
    )


def sharded_dropout_rng(enabled: bool) -> contextlib.AbstractContextManager:
    """Draw from the tracker's per-TP-rank stream when ``enabled``: dropout on a tensor that
    differs across TP ranks (a head or sequence shard) must not repeat one mask on every shard."""
    return _TRACKER.fork() if enabled else contextlib.nullcontext()


def checkpoint_rng_contexts() -> tuple[contextlib.AbstractContextManager, ...]:
    """``context_fn`` for ``torch.utils.checkpoint(use_reentrant=False)``: the recompute replays
    the tracker's streams from where the forward started them, then puts back the current ones.

    torch's checkpoint restores only the default generator, so a `fork` inside a recomputed
    region would otherwise draw a different (later) mask than the forward did, and the gradient
    would belong to another dropout pattern. This is what Megatron's own CheckpointFunction does.
    """
    states_at_forward = _TRACKER.get_states()

    @contextlib.contextmanager
    def replay() -> Iterator[None]:
        current = _TRACKER.get_states()
        _TRACKER.set_states(states_at_forward)
        try:
            yield
        finally:
            _TRACKER.set_states(current)

    return contextlib.nullcontext(), replay()


def checkpoint(function: Callable, *args):
    """``function(*args)`` under torch's non-reentrant activation checkpoint; with more than
    one tensor-parallel rank the recompute also replays the tracker's streams
    (`checkpoint_rng_contexts`), which the per-rank parts inside the region
    (megatron.tensor_parallel.parts) draw from. Without tensor parallelism nothing forks, and
    the plain checkpoint is what torch.compile can trace (it refuses a ``context_fn`` of this
    kind)."""
    tensor_parallel = (
        parallel_state.model_parallel_is_initialized()
        and parallel_state.get_tensor_model_parallel_world_size() > 1
    )
    replay = {"context_fn": checkpoint_rng_contexts} if tensor_parallel else {}
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **replay)
