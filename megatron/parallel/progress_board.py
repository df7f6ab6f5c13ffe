"""Which rank a collective waited for, when it timed out (--distributed-timeout-minutes).

A rank that stops answering (a deadlock, a stuck file system, a dead GPU, a rank sleeping in a
step) leaves the others blocked in their next collective until the process group's timeout;
what torch then raises names neither the collective nor the rank ("Timed out waiting 600000ms
for recv operation to complete"). So every rank writes where it is into the process group's
store (one short key per iteration, save and evaluation), and a rank whose collective timed out
marks itself, gives the other waiting ranks a moment to time out too, and names the ranks that
did not: those are the ones that never arrived.
"""

from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import List, Optional

import torch.distributed as dist

_WHERE = "megatron/progress/where/{rank}"
_TIMED_OUT = "megatron/progress/timed_out/{rank}"
# The most a timed-out rank waits for the others to time out as well.
GRACE_SECONDS = 30.0
# Frames of the project (not of torch or other libraries) start with this path: the
# repository root, above megatron/parallel/.
_PROJECT = str(Path(__file__).resolve().parents[2]) + os.sep


def is_collective_timeout(error: BaseException) -> bool:
    """Whether `error` is a collective that ran past the process group's timeout (gloo's and
    NCCL's wordings)."""
    if not isinstance(error, RuntimeError):
        return False
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def _is_project_file(filename: str) -> bool:
    """A file of this repository, not of a library installed inside it (a virtual environment
    created in the checkout, such as `.venv/`, also lies under the repository root)."""
    return filename.startswith(_PROJECT) and not any(
        part in filename for part in ("site-packages", "dist-packages")
    )


def _collective_of(error: BaseException) -> str:
    """The torch.distributed call that raised `error` and the project code that called it, from
    the traceback; gradients reduced by DDP during backward have no Python frame of their own."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [i for i, frame in enumerate(frames) if _is_project_file(frame.filename)]
    if not ours:
        return "a collective"
    caller = frames[ours[-1]]
    where = f"{os.path.relpath(caller.filename, _PROJECT)}:{caller.lineno} ({caller.name})"
    below = frames[ours[-1] + 1 :]
    called = [f.name for f in below if f.filename.endswith("distributed_c10d.py")]
    if called:
        return f"{called[0]} called from {where}"
    if any("autograd" in frame.filename for frame in below):
        return f"the gradient reduction during backward, called from {where}"
    return f"a collective called from {where}"


class ProgressBoard:
    """This rank's entries in the default process group's store."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout: timedelta):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout

    @classmethod
    def of_default_group(cls, timeout: timedelta) -> Optional[ProgressBoard]:
        """The board of the default process group, or None in a single process."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        store = dist.distributed_c10d._get_default_store()
        return cls(store, dist.get_rank(), dist.get_world_size(), timeout)

    def mark(self, where: str) -> None:
        """Record that this rank has reached `where` (e.g. "iteration 12")."""
        self.store.set(_WHERE.format(rank=self.rank), where)

    def _read(self, key: str) -> Optional[str]:
        # check() does not block; get() of a missing key would wait for the store's timeout.
        if not self.store.check([key]):
            return None
        return self.store.get(key).decode()

    def explain_timeout(self, error: BaseException, grace: float = GRACE_SECONDS) -> str:
        """One line for a collective that timed out on this rank: what it waited in, where,
        and which ranks did not arrive (those that have not timed out themselves after up to
        `grace` seconds, or the timeout, if shorter)."""
        self.store.set(_TIMED_OUT.format(rank=self.rank), "1")
        others = [rank for rank in range(self.world_size) if rank != self.rank]
        deadline = time.monotonic() + min(grace, self.timeout.total_seconds())
        missing: List[int] = others
        while True:
            missing = [r for r in others if self._read(_TIMED_OUT.format(rank=r)) is None]
            if not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        minutes = self.timeout.total_seconds() / 60
        here = self._read(_WHERE.format(rank=self.rank)) or "setup"
        line = (
            f"rank {self.rank} waited {minutes:g} min (--distributed-timeout-minutes) in "
            f"{_collective_of(error)} during {here}"
        )
        if not missing:
            return line + "; every rank timed out: none is known to be behind"
        seen = [f"rank {r} at {self._read(_WHERE.format(rank=r)) or 'setup'}" for r in missing]
        return (
            f"{line}; rank{'s' if len(missing) > 1 else ''} "
            f"{', '.join(str(r) for r in missing)} never arrived (last seen: {', '.join(seen)}): "
            "hung or far slower than the others"
        )
