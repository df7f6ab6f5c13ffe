"""torch.distributed's collectives under every name the project calls them by, for the tests
that replace them (the tensor-parallel layers' refusal of in-place collectives, the
distributed optimizer's record of what runs behind its parameter gather).

Replacing `torch.distributed.all_reduce` alone misses a call through a name bound at import:
megatron.parallel.collectives binds `reduce_scatter_single` and `all_gather_single` to the
running torch's in-place functions, and megatron.optimizer.sharded_buffer imports those under
names of its own. `replaced_collectives` replaces torch.distributed's attributes and every
global of a loaded project module that is the same function; a project module imported inside
the block binds the replacement, since it takes it from torch.distributed.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Dict, Iterator, List, Tuple

import torch.distributed as dist

# The collectives that write their result into a tensor the caller passed (all of torch's but
# the functional ones), under torch 2.4-2.13's names, and barrier, which waits for a group.
COLLECTIVES = tuple(
    name
    for name in (
        "all_reduce",
        "all_reduce_coalesced",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_single",
        "all_gather_coalesced",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "all_to_all",
        "all_to_all_single",
        "broadcast",
        "reduce",
        "gather",
        "scatter",
        "barrier",
    )
    if hasattr(dist, name)
)
IN_PLACE_COLLECTIVES = tuple(name for name in COLLECTIVES if name != "barrier")
PROJECT_PACKAGES = ("megatron", "moe", "gpt_pretraining", "pretrain_gpt")


def bindings(names: Tuple[str, ...]) -> List[Tuple[object, str, str]]:
    """(namespace, attribute, collective name) of every place a collective of `names` is
    reachable: torch.distributed, and each loaded project module's globals."""
    name_of: Dict[int, str] = {id(getattr(dist, name)): name for name in names}
    found = [(dist, name, name) for name in names]
    for module_name, module in list(sys.modules.items()):
        if module is None or module_name.split(".")[0] not in PROJECT_PACKAGES:
            continue
        for attribute, value in list(vars(module).items()):
            if id(value) in name_of:
                found.append((module, attribute, name_of[id(value)]))
    return found


@contextlib.contextmanager
def replaced_collectives(
    replacement: Callable[[str, Callable], Callable], names: Tuple[str, ...] = COLLECTIVES
) -> Iterator[List[Tuple[object, str, str]]]:
    """Within the block, every binding of the collectives `names` (module docstring) is
    `replacement(name, original)`; the bindings replaced, for the caller to check that the
    names it relies on are among them. Restored on exit."""
    replaced = bindings(names)
    originals = [getattr(namespace, attribute) for namespace, attribute, _ in replaced]
    for (namespace, attribute, name), original in zip(replaced, originals):
        setattr(namespace, attribute, replacement(name, original))
    try:
        yield replaced
    finally:
        for (namespace, attribute, _), original in zip(replaced, originals):
            setattr(namespace, attribute, original)
