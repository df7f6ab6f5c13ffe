"""The single owner of process groups: tensor (TP), pipeline (PP), data (DP) and expert (EP)
parallelism, plus the groups derived from them (model-parallel, embedding, expert-data-parallel)
and a gloo group of every rank for checkpoints.

Rank layout follows Megatron-Core's default order ``tp-cp-ep-dp-pp`` (context parallel size 1):
a global rank is ``tp_rank + tp * (dp_rank + dp * pp_rank)``, so tensor-parallel peers are
adjacent ranks (one node, the fastest links) and pipeline stages are the slowest-varying
coordinate. Expert parallelism is carved out of data parallelism as Megatron-Core does it: the
``dp`` coordinate splits into ``ep`` (fastest) and "expert data parallel" (slowest), so EP
peers are the DP ranks closest to each other and expert-data-parallel groups connect the DP
ranks that hold the same experts.

Before `initialize_model_parallel` (or after `destroy_model_parallel`), rank and size queries
answer as for tensor = pipeline = expert parallel size 1: TP/PP/EP ranks are 0 with size 1 and
the data-parallel rank and size are those of the whole job (``torch.distributed`` if it is
initialized, else rank 0 of 1). That lets layers and tests run in a single process without any
set-up. Group getters, in contrast, raise: a collective on a group nobody created is a bug.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Optional, Sequence

import torch.distributed as dist

# Megatron-Core's default rank order, fastest-varying first ("cp" is always 1 here).
RANK_ORDER = ("tp", "cp", "ep", "dp", "pp")


def _rank_groups(sizes: dict[str, int], members: Sequence[str]) -> list[list[int]]:
    """Groups of global ranks that differ only in the coordinates named in ``members``.

    ``sizes`` maps every name of `RANK_ORDER` to its size. Within a group, and across groups,
    coordinates earlier in `RANK_ORDER` vary fastest, which is the order Megatron-Core lists
    its groups in (all ranks must create groups in one order, so the order matters).
    """
    strides: dict[str, int] = {}
    stride = 1
    for name in RANK_ORDER:
        strides[name] = stride
        stride *= sizes[name]
    inner = [name for name in RANK_ORDER if name in members]
    outer = [name for name in RANK_ORDER if name not in members]

    def offsets(names: list[str]) -> list[int]:
        # Mixed-radix enumeration, first name fastest.
        result = [0]
        for name in names:
            result = [
                base + index * strides[name] for index in range(sizes[name]) for base in result
            ]
        return result

    return [[base + offset for offset in offsets(inner)] for base in offsets(outer)]


def parallel_rank_groups(
    world_size: int,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
) -> dict[str, list[list[int]]]:
    """Every group's global ranks for this layout, without creating anything.

    Keys: ``tensor``, ``pipeline``, ``data``, ``model`` (TP x PP), ``embedding`` (first and
    last stage of each pipeline), ``expert`` and ``expert_data``. Raises ValueError, naming the
    numbers, when the sizes do not divide the world.
    """
    tp, pp, ep = (
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        expert_model_parallel_size,
    )
    for name, size in (("tensor", tp), ("pipeline", pp), ("expert", ep)):
        if size < 1:
            raise ValueError(f"{name} model parallel size must be at least 1, got {size}")
    if world_size % (tp * pp) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor ({tp}) x pipeline ({pp}) "
            f"model parallel size; choose sizes whose product divides the number of processes"
        )
    dp = world_size // (tp * pp)
    if dp % ep != 0:
        raise ValueError(
            f"expert model parallel size {ep} does not divide the data parallel size {dp} "
            f"(world size {world_size} / (tensor {tp} x pipeline {pp})); experts are sharded "
            f"over data-parallel ranks, so choose an expert parallel size that divides {dp}"
        )
    dense = {"tp": tp, "cp": 1, "ep": 1, "dp": dp, "pp": pp}
    # Expert layers see the same world with the dp coordinate split into ep x expert-dp.
    expert = {"tp": tp, "cp": 1, "ep": ep, "dp": dp // ep, "pp": pp}
    pipeline = _rank_groups(dense, ["pp"])
    return {
        "tensor": _rank_groups(dense, ["tp"]),
        "pipeline": pipeline,
        "data": _rank_groups(dense, ["dp"]),
        "model": _rank_groups(dense, ["tp", "pp"]),
        "embedding": [sorted({ranks[0], ranks[-1]}) for ranks in pipeline],
        "expert": _rank_groups(expert, ["ep"]),
        "expert_data": _rank_groups(expert, ["dp"]),
    }


@dataclass
class _Group:
    """One process group this rank belongs to, with its members' global ranks."""

    group: Optional[dist.ProcessGroup]  # None in a single process without torch.distributed
    ranks: list[int]

    def rank(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)


@dataclass
class _ParallelState:
    global_rank: int
    groups: dict[str, _Group]  # keyed like parallel_rank_groups
    virtual_pipeline_size: Optional[int]
    virtual_pipeline_rank: Optional[int]


_STATE: Optional[_ParallelState] = None


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    timeout: Optional[timedelta] = None,
) -> None:
    """Create the TP, PP, DP, EP, expert-DP, model-parallel, embedding and checkpoint groups.

    Every rank must call this (``new_group`` is collective). Without ``torch.distributed``
    the world is one process and only sizes of 1 are accepted. `timeout`: how long their
    collectives wait (--distributed-timeout-minutes; torch gives new groups its own default,
    not the default group's).
    """
    global _STATE
    if _STATE is not None:
        raise RuntimeError(
            "model parallel groups are already initialized; call destroy_model_parallel() first"
        )
    distributed = dist.is_available() and dist.is_initialized()
    world_size = dist.get_world_size() if distributed else 1
    global_rank = dist.get_rank() if distributed else 0
    layout = parallel_rank_groups(
        world_size,
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        expert_model_parallel_size,
    )
    if virtual_pipeline_model_parallel_size is not None and (
        pipeline_model_parallel_size < 2 or virtual_pipeline_model_parallel_size < 1
    ):
        raise ValueError(
            f"virtual pipeline model parallel size {virtual_pipeline_model_parallel_size} needs "
            f"a pipeline model parallel size above 1 (got {pipeline_model_parallel_size}) and "
            f"a value of at least 1 (the interleaved schedule splits each stage into chunks)"
        )
    groups: dict[str, _Group] = {}
    for kind, all_ranks in layout.items():
        for ranks in all_ranks:
            # new_group is collective over the whole world: every rank creates every group.
            group = dist.new_group(ranks, timeout=timeout) if distributed else None
            if global_rank in ranks:
                groups[kind] = _Group(group, ranks)
    every_rank = list(range(world_size))
    # Checkpoints coordinate on CPU objects over gloo, whatever the training backend, and an
    # asynchronous save does so from a background thread: a group of its own keeps those
    # collectives apart from the training ones.
    groups["checkpoint"] = _Group(
        dist.new_group(every_rank, backend="gloo", timeout=timeout) if distributed else None,
        every_rank,
    )
    _STATE = _ParallelState(
        global_rank,
        groups,
        virtual_pipeline_model_parallel_size,
        0 if virtual_pipeline_model_parallel_size is not None else None,
    )


def get_checkpoint_group() -> Optional[dist.ProcessGroup]:
    """Every rank, on gloo, for checkpoint saving and loading (the default group before
    `initialize_model_parallel`)."""
    return _STATE.groups["checkpoint"].group if _STATE is not None else None


def destroy_model_parallel() -> None:
    """Forget every group (queries fall back to the uninitialized defaults)."""
    global _STATE
    _STATE = None


def model_parallel_is_initialized() -> bool:
    """Whether `initialize_model_parallel` has run (and `destroy_model_parallel` has not)."""
    return _STATE is not None


def _group(kind: str) -> _Group:
    if _STATE is None:
        raise RuntimeError(
            f"the {kind} parallel group does not exist yet: call "
            f"megatron.parallel.parallel_state.initialize_model_parallel() first"
        )
    if kind not in _STATE.groups:
        # Only the embedding group leaves ranks out: the middle pipeline stages.
        raise RuntimeError(
            f"global rank {_STATE.global_rank} is in no {kind} group; "
            f"check is_rank_in_embedding_group() before asking for it"
        )
    return _STATE.groups[kind]


def _size(kind: str) -> int:
    if _STATE is not None:
        return len(_STATE.groups[kind].ranks)
    if kind == "data" and dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def _rank(kind: str) -> int:
    if _STATE is not None:
        return _STATE.groups[kind].rank(_STATE.global_rank)
    if kind == "data" and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def _process_group(kind: str) -> Optional[dist.ProcessGroup]:
    return _group(kind).group


# Tensor model parallel ------------------------------------------------------------------------
def get_tensor_model_parallel_group() -> Optional[dist.ProcessGroup]:
    """The tensor-model-parallel group of this rank (None in a single process without dist)."""
    return _process_group("tensor")


def get_tensor_model_parallel_world_size() -> int:
    """Number of ranks a tensor-parallel layer is split over."""
    return _size("tensor")


def get_tensor_model_parallel_rank() -> int:
    """This rank's index within its tensor-model-parallel group."""
    return _rank("tensor")


# Pipeline model parallel ----------------------------------------------------------------------
def get_pipeline_model_parallel_group() -> Optional[dist.ProcessGroup]:
    """The pipeline group of this rank: one rank per stage."""
    return _process_group("pipeline")


def get_pipeline_model_parallel_world_size() -> int:
    """Number of pipeline stages."""
    return _size("pipeline")


def get_pipeline_model_parallel_rank() -> int:
    """This rank's pipeline stage."""
    return _rank("pipeline")


def get_pipeline_model_parallel_first_rank() -> int:
    """Global rank of the first stage of this rank's pipeline."""
    return _group("pipeline").ranks[0] if _STATE is not None else _global_rank()


def get_pipeline_model_parallel_last_rank() -> int:
    """Global rank of the last stage of this rank's pipeline."""
    return _group("pipeline").ranks[-1] if _STATE is not None else _global_rank()


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage (the last stage's next is the first, as in Megatron)."""
    if _STATE is None:
        return _global_rank()
    ranks = _STATE.groups["pipeline"].ranks
    return ranks[(get_pipeline_model_parallel_rank() + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous stage (the first stage's previous is the last)."""
    if _STATE is None:
        return _global_rank()
    ranks = _STATE.groups["pipeline"].ranks
    return ranks[(get_pipeline_model_parallel_rank() - 1) % len(ranks)]


def get_virtual_pipeline_model_parallel_world_size() -> Optional[int]:
    """Model chunks per stage with the interleaved schedule; None without interleaving."""
    return _STATE.virtual_pipeline_size if _STATE is not None else None


def get_virtual_pipeline_model_parallel_rank() -> Optional[int]:
    """The model chunk the interleaved schedule is running now; None without interleaving."""
    return _STATE.virtual_pipeline_rank if _STATE is not None else None


def set_virtual_pipeline_model_parallel_rank(rank: int) -> None:
    """Select the model chunk; the interleaved schedule sets this before each chunk runs."""
    if _STATE is None or _STATE.virtual_pipeline_size is None:
        raise RuntimeError(
            "set_virtual_pipeline_model_parallel_rank needs initialize_model_parallel("
            "virtual_pipeline_model_parallel_size=...) first"
        )
    if not 0 <= rank < _STATE.virtual_pipeline_size:
        raise ValueError(
            f"virtual pipeline rank {rank} is outside [0, {_STATE.virtual_pipeline_size})"
        )
    _STATE.virtual_pipeline_rank = rank


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    """Whether this rank (and, with interleaving, its current chunk) holds the model's input."""
    if not ignore_virtual and get_virtual_pipeline_model_parallel_rank() not in (None, 0):
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    """Whether this rank (and, with interleaving, its current chunk) computes the loss."""
    virtual_size = get_virtual_pipeline_model_parallel_world_size()
    if not ignore_virtual and virtual_size is not None:
        if get_virtual_pipeline_model_parallel_rank() != virtual_size - 1:
            return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


# Data parallel --------------------------------------------------------------------------------
def get_data_parallel_group() -> Optional[dist.ProcessGroup]:
    """Ranks holding the same dense-model shard: gradients of dense weights reduce here."""
    return _process_group("data")


def get_data_parallel_world_size() -> int:
    """Number of model replicas (the whole job before initialize_model_parallel)."""
    return _size("data")


def get_data_parallel_rank() -> int:
    """This rank's replica index: which slice of the global batch it reads."""
    return _rank("data")


# Expert parallel ------------------------------------------------------------------------------
def get_expert_model_parallel_group() -> Optional[dist.ProcessGroup]:
    """Data-parallel ranks that split the experts among themselves (the all-to-all group)."""
    return _process_group("expert")


def get_expert_model_parallel_world_size() -> int:
    """Number of ranks the experts are split over."""
    return _size("expert")


def get_expert_model_parallel_rank() -> int:
    """Which slice of the experts this rank holds."""
    return _rank("expert")


def get_expert_data_parallel_group() -> Optional[dist.ProcessGroup]:
    """Ranks holding the same experts: gradients of expert weights reduce here."""
    return _process_group("expert_data")


def get_expert_data_parallel_world_size() -> int:
    """Number of replicas of each expert (data parallel size / expert parallel size)."""
    if _STATE is None:
        return get_data_parallel_world_size()
    return _size("expert_data")


def get_expert_data_parallel_rank() -> int:
    """This rank's index among the replicas of its experts."""
    if _STATE is None:
        return get_data_parallel_rank()
    return _rank("expert_data")


# Derived groups -------------------------------------------------------------------------------
def get_model_parallel_group() -> Optional[dist.ProcessGroup]:
    """The TP x PP ranks that together hold one full copy of the model."""
    return _process_group("model")


def get_embedding_group() -> Optional[dist.ProcessGroup]:
    """First and last pipeline stage of this pipeline: tied word-embedding grads reduce here."""
    return _process_group("embedding")


def is_rank_in_embedding_group() -> bool:
    """Whether this rank holds a copy of the word embeddings (first or last stage)."""
    if _STATE is None:
        return True
    return "embedding" in _STATE.groups


def _global_rank() -> int:
    if _STATE is not None:
        return _STATE.global_rank
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
