"""Loading `--ckpt-format torch_dist`: checksums verified by all ranks, optimizer state put back.

Every rank verifies a share of the files in `checksums.json` (each file once, in parallel),
and the outcome is the same on every rank. The optimizer's per-parameter state arrives in
tensors that megatron.checkpointing.sharded_state allocated; `load_inner_optimizer_state`
hands them, with the saved hyper-parameters and loss scaler, to the torch optimizer.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist

from megatron.checkpointing.checksums import (
    CHECKSUMS_FILENAME,
    ManifestError,
    find_damage,
    read_manifest,
)
from megatron.checkpointing.layout import CheckpointError, Iteration, earlier_checkpoint_advice
from megatron.checkpointing.sharded_state import inner_optimizer
from megatron.checkpointing.torch_dist import rank_and_size
from megatron.optimizer.optimizer import load_keeping_kernel_flags


def verify_sharded_checkpoint(
    root: str,
    iteration: Iteration,
    directory: str,
    group: Optional[dist.ProcessGroup],
    print_fn: Callable[[str], None],
) -> bool:
    """Check every file of `directory` against `checksums.json`, the files shared out over the
    ranks of `group` (a collective); raise CheckpointError on every rank at the first damage.
    False when there is no checksums.json (the caller says so: megatron.checkpointing.load)."""
    try:
        manifest = read_manifest(directory)
    except ManifestError as error:
        raise CheckpointError(
            f"{error}, so {directory} cannot be verified; "
            f"{earlier_checkpoint_advice(root, iteration)} (or delete {CHECKSUMS_FILENAME} "
            "to load it unverified)"
        ) from None
    if manifest is None:
        return False
    rank, size = rank_and_size(group)
    names = sorted(manifest.files)
    start = time.perf_counter()
    damage = None
    for name in names[rank::size]:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            damage = f"checkpoint file {path} is missing"
        else:
            found = find_damage(path, manifest.files[name], manifest.block_size)
            if found is not None:
                damage = f"checkpoint file {path} is damaged: {found}"
        if damage is not None:
            break
    outcome = (damage, time.perf_counter() - start)
    outcomes = [outcome]
    if dist.is_initialized():
        outcomes = [None] * size
        dist.all_gather_object(outcomes, outcome, group=group)
    damages = [found for found, _ in outcomes if found is not None]
    if damages:
        raise CheckpointError(
            f"{damages[0]} (checksums in {manifest.path}); "
            f"{earlier_checkpoint_advice(root, iteration)}"
        )
    total = sum(record.size for record in manifest.files.values())
    seconds = max(seconds for _, seconds in outcomes)
    print_fn(
        f"verified the checksums of {directory} ({len(names)} files, {total / 1e9:.2f} GB) "
        f"in {seconds:.1f} s"
    )
    return True


def load_inner_optimizer_state(
    optimizer: Any, state: Dict[int, Dict[str, torch.Tensor]], common: Dict[str, Any]
) -> None:
    """Give `optimizer`'s inner torch optimizer `state` (in its numbering) and the saved
    hyper-parameters of its groups (matched by position, or by weight-decay multiplier where a
    stage has fewer groups), then the loss scaler."""
    inner = inner_optimizer(optimizer)
    saved_groups = common["param_groups"]
    param_groups, start = [], 0
    for position, group in enumerate(inner.param_groups):
        if len(saved_groups) == len(inner.param_groups):
            hyperparameters = saved_groups[position]
        else:  # a pipeline stage without one of the groups global rank 0 saved
            matching = [g for g in saved_groups if g.get("wd_mult") == group.get("wd_mult")]
            hyperparameters = (
                matching[0] if matching else {k: v for k, v in group.items() if k != "params"}
            )
        count = len(group["params"])
        param_groups.append({**hyperparameters, "params": list(range(start, start + count))})
        start += count
    load_keeping_kernel_flags(inner, {"state": state, "param_groups": param_groups})
    grad_scaler = getattr(optimizer, "grad_scaler", None)
    if grad_scaler is not None and "grad_scaler" in common:
        grad_scaler.load_state_dict(common["grad_scaler"])
