"""Non-finite values in a run's state: a checkpoint is never saved with them, and one loaded
without checksums is checked for them before training starts (a NaN there would be trained on
and saved again)."""

from __future__ import annotations

from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.checkpointing.checksums import CHECKSUMS_FILENAME
from megatron.checkpointing.layout import CheckpointError, Iteration, earlier_checkpoint_advice
from megatron.initialize import first_from_any_rank


def optimizer_tensors(
    optimizer: Any, parameter_names: Dict[int, str]
) -> Iterator[Tuple[str, torch.Tensor]]:
    """The tensors of the inner torch optimizer's state (Adam's moments, ...), named by the
    state's key and the parameter's name in `parameter_names` (by id; else its index: the
    distributed optimizer's state belongs to pieces of parameters)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    for index, (param, state) in enumerate(inner.state.items()):
        owner = parameter_names.get(id(param), f"parameter {index}")
        for key, value in state.items():
            if torch.is_tensor(value) and value.is_floating_point():
                yield f"the optimizer's {key} of {owner}", value


def first_non_finite(named: Iterable[Tuple[str, torch.Tensor]]) -> Optional[str]:
    """The name of the first tensor holding a NaN or an infinity (with what it holds), or None.
    One device sync per tensor that has one; a reduction per tensor otherwise."""
    for name, tensor in named:
        if tensor.numel() == 0 or not tensor.is_floating_point():
            continue
        finite = torch.isfinite(tensor.detach())
        if not bool(finite.all()):
            bad = tensor.detach()[~finite]
            kinds = []
            if bool(torch.isnan(bad).any()):
                kinds.append("NaN")
            if bool(torch.isinf(bad).any()):
                kinds.append("inf")
            return f"{name} ({bad.numel()} of {tensor.numel()} values {' and '.join(kinds)})"
    return None


def agreed_first_non_finite(named: Iterable[Tuple[str, torch.Tensor]]) -> Optional[str]:
    """`first_non_finite` over every rank's tensors (a collective over all ranks): the same
    answer on each, naming the rank that found it."""
    found = first_from_any_rank(first_non_finite(named))
    if found is None:
        return None
    rank, answer = found
    alone = not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1
    return answer if alone else f"{answer} on rank {rank}"


def unverified_note(checkpoint: Any, checked: str) -> str:
    """The note for a checkpoint (`directory`, `state`) loaded without checksums: whether it
    had some (new saves record so) and what is `checked` instead."""
    if checkpoint.state.get("checksums"):
        why = "though it was saved with one: deleted or lost since"
    else:
        why = "saved by an older version or by Megatron-LM"
    return (
        f"note: {checkpoint.directory} has no {CHECKSUMS_FILENAME} ({why}): it is loaded "
        f"unverified, {checked}"
    )


def refuse_non_finite_load(
    parameters: List[Tuple[str, torch.Tensor]],
    optimizer: Any,
    directory: str,
    root: str,
    iteration: Iteration,
) -> None:
    """A checkpoint without checksums may be damaged where nothing else would notice: the
    weights (named `parameters`) and optimizer state it gave must be finite, else
    CheckpointError (a collective over all ranks)."""
    tensors = list(parameters)
    if optimizer is not None:
        names = {id(param): name for name, param in parameters}
        tensors += list(optimizer_tensors(optimizer, names))
    bad = agreed_first_non_finite(tensors)
    if bad is not None:
        raise CheckpointError(
            f"{directory} (loaded without checksums) holds non-finite values: {bad}; "
            f"{earlier_checkpoint_advice(root, iteration)}"
        )
