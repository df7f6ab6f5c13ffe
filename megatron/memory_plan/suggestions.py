"""Flags that would make a run fit its GPU, each proven by estimating the changed config.

Tried in order, each alone: a smaller --micro-batch-size (the largest that fits), full
recomputation, precision-aware optimizer states in bf16, optimizer offload, the distributed
optimizer (data-parallel > 1, replicated runs only), expert parallelism (MoE with
data-parallel > 1, not under hybrid FSDP2). When none fits alone, they are combined in that
order until the combination fits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

from megatron.memory_plan.estimate import MemoryEstimate, estimate_memory, gib
from megatron.parallelize.data_parallel import Replicated
from megatron.parallelize.data_parallel_mode import data_parallel_mode

if TYPE_CHECKING:
    from megatron.config import Config
    from megatron.model import MlpSpec

SpecBuilder = Callable[["Config"], "MlpSpec"]


@dataclass(frozen=True)
class Suggestion:
    """Flags to add and the estimate of the run with them."""

    flags: str
    estimate: MemoryEstimate


def _micro_batch(config: Config, size: int) -> Config:
    training = config.training
    per_step = training.global_batch_size // config.parallel.data_parallel_size
    return dataclasses.replace(
        config,
        training=dataclasses.replace(
            training, micro_batch_size=size, num_micro_batches=per_step // size
        ),
    )


def _changes(config: Config, mlp_spec: MlpSpec) -> List[Tuple[str, Callable[[Config], Config]]]:
    """(flags, change) candidates that apply to `config` (whose layers `mlp_spec` builds), in
    the module docstring's order."""
    model, optimizer, parallel = config.model, config.optimizer, config.parallel
    changes: List[Tuple[str, Callable[[Config], Config]]] = []
    if model.recompute_granularity != "full":
        changes.append(
            (
                "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
                lambda c: dataclasses.replace(
                    c,
                    model=dataclasses.replace(
                        c.model,
                        recompute_granularity="full",
                        recompute_method="uniform",
                        recompute_num_layers=1,
                    ),
                ),
            )
        )
    data_parallel = data_parallel_mode(config)
    # FSDP2's DTensor shards take neither the precision-aware optimizer nor the offload.
    replicas_hold_state = not data_parallel.shards_parameters
    low = {"main_grads_dtype": "bf16", "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"}
    if (
        replicas_hold_state
        and optimizer.optimizer == "adam"
        and any(getattr(optimizer, k) != v for k, v in low.items())
    ):
        changes.append(
            (
                "--use-precision-aware-optimizer --main-grads-dtype bf16 --exp-avg-dtype bf16 "
                "--exp-avg-sq-dtype bf16",
                lambda c: dataclasses.replace(
                    c,
                    optimizer=dataclasses.replace(
                        c.optimizer, use_precision_aware_optimizer=True, **low
                    ),
                ),
            )
        )
    if (
        replicas_hold_state
        and optimizer.optimizer == "adam"
        and not (optimizer.optimizer_cpu_offload and optimizer.optimizer_offload_fraction == 1.0)
    ):
        changes.append(
            (
                "--optimizer-cpu-offload --optimizer-offload-fraction 1.0",
                lambda c: dataclasses.replace(
                    c,
                    optimizer=dataclasses.replace(
                        c.optimizer, optimizer_cpu_offload=True, optimizer_offload_fraction=1.0
                    ),
                ),
            )
        )
    # The distributed optimizer replaces replication; FSDP2 shards the optimizer state itself.
    replicated = isinstance(data_parallel, Replicated)
    if parallel.data_parallel_size > 1 and replicated:
        changes.append(
            (
                "--use-distributed-optimizer",
                lambda c: dataclasses.replace(
                    c, parallel=dataclasses.replace(c.parallel, use_distributed_optimizer=True)
                ),
            )
        )
    expert_size = _expert_parallel_size_to_try(config, mlp_spec)
    if expert_size is not None:
        changes.append(
            (
                f"--expert-model-parallel-size {expert_size}",
                lambda c: _with_expert_parallel_size(c, expert_size),
            )
        )
    return changes


def _expert_parallel_size_to_try(config: Config, mlp_spec: MlpSpec) -> Optional[int]:
    """The largest expert-parallel size above the current one that the data-parallel ranks and
    the model's expert layers allow; None if there is none (or under hybrid FSDP2, which
    expert parallelism does not compose with)."""
    parallel = config.parallel
    if parallel.data_parallel_replicate_degree > 1:
        return None
    sizes = mlp_spec.expert_parallel_sizes(parallel.data_parallel_size)
    larger = [size for size in sizes if size > parallel.expert_model_parallel_size]
    return larger[-1] if larger else None


def _with_expert_parallel_size(config: Config, size: int) -> Config:
    return dataclasses.replace(
        config, parallel=dataclasses.replace(config.parallel, expert_model_parallel_size=size)
    )


def suggest_fits(
    config: Config,
    build_mlp_spec: SpecBuilder,
    device_memory: int,
    **estimate_options,
) -> List[Suggestion]:
    """Suggestions whose estimate fits `device_memory` bytes (see the module docstring)."""

    def estimate(changed: Config) -> MemoryEstimate:
        return estimate_memory(changed, build_mlp_spec(changed), device_memory, **estimate_options)

    found: List[Suggestion] = []
    training = config.training
    per_step = training.global_batch_size // config.parallel.data_parallel_size
    for size in range(training.micro_batch_size - 1, 0, -1):
        if per_step % size == 0:
            smaller = estimate(_micro_batch(config, size))
            if smaller.fits:
                found.append(Suggestion(f"--micro-batch-size {size}", smaller))
                break
    changes = _changes(config, build_mlp_spec(config))
    for flags, change in changes:
        changed = estimate(change(config))
        if changed.fits:
            found.append(Suggestion(flags, changed))
    if found:
        return found
    combined, combined_flags = config, []
    for flags, change in changes:
        combined = change(combined)
        combined_flags.append(flags)
        changed = estimate(combined)
        if changed.fits:
            return [Suggestion(" ".join(combined_flags), changed)]
    return []


def format_warning(estimate: MemoryEstimate, suggestions: List[Suggestion]) -> str:
    """Megatron-style one-line warning for a run that will not fit."""
    line = (
        f"WARNING: the estimated peak memory per GPU, {gib(estimate.total)} GiB, exceeds the "
        f"GPU's {gib(estimate.device_memory or 0)} GiB"
    )
    if not suggestions:
        return (
            f"{line}; no change of micro batch, recomputation, optimizer states or parallelism "
            "makes it fit: use more GPUs (tensor or pipeline parallelism)"
        )
    options = "; ".join(f"{s.flags} ({gib(s.estimate.total)} GiB)" for s in suggestions)
    return f"{line}; it would fit with: {options}"
