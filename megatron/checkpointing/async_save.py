"""`--async-save`: training waits only while the state is copied to host memory.

`AsyncCheckpointWriter.stage` copies this rank's chunks (megatron.checkpointing.sharded_state)
into host buffers (megatron.checkpointing.host_memory: page-locked when a GPU is present,
allocated in the background before the first save and kept for the next), and `start` hands the
write (megatron.checkpointing.sharded_save) to a background thread, whose collectives run on
the checkpoint group (gloo), apart from training's. The tracker moves only when every rank's
files are complete; a crash or a full disk meanwhile leaves the previous checkpoint the
latest. `wait` joins an unfinished write: the next save and the end of training call it, and
it raises the write's failure on every rank.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn

from megatron.checkpointing.chunks import ChunkedTensor, Offsets
from megatron.checkpointing.host_memory import allocate_host_buffers
from megatron.checkpointing.layout import CheckpointError
from megatron.checkpointing.sharded_save import sharded_tensors


class AsyncCheckpointWriter:
    """One background checkpoint write at a time, and the host buffers it reuses."""

    def __init__(self) -> None:
        self._buffers: Dict[Tuple[str, Offsets], torch.Tensor] = {}
        self._allocating: Optional[threading.Thread] = None
        self._allocated: Optional[str] = None
        self._thread: Optional[threading.Thread] = None
        self._outcome: Optional[str] = None
        self._done_message: Optional[str] = None

    @property
    def prepared(self) -> bool:
        """Whether `prepare` has run (its buffers are allocated, or being allocated)."""
        return self._allocating is not None or bool(self._buffers)

    def prepare(self, model: nn.Module, optimizer: Any) -> None:
        """Allocate the host buffers for the chunks of `model` and `optimizer` (None: not saved)
        in the background, once, so that no save blocks training while tens of GB are
        allocated and page-locked. Call it once the optimizer has its state."""
        if self.prepared:
            return
        shapes = {
            (name, offsets): (tensor.shape, tensor.dtype)
            for name, chunked in sharded_tensors(model, optimizer).items()
            for offsets, tensor in chunked.chunks
        }
        started = time.perf_counter()

        def allocate() -> None:
            buffers = allocate_host_buffers(shapes, pin=torch.cuda.is_available())
            self._buffers.update(buffers.tensors)
            seconds = time.perf_counter() - started
            self._allocated = f"{buffers.describe()} for --async-save ready in {seconds:.1f} s"

        self._allocating = threading.Thread(target=allocate, name="checkpoint-buffers", daemon=True)
        self._allocating.start()

    def stage(
        self, tensors: Dict[str, ChunkedTensor], print_fn: Callable[[str], None] = print
    ) -> Dict[str, ChunkedTensor]:
        """Host copies of `tensors`, in buffers kept from the previous save (or `prepare`d)
        when they fit. The first call waits for `prepare`'s buffers and says how they were
        made ready (and how long it waited for them)."""
        if self._allocating is not None:
            waited = time.perf_counter()
            self._allocating.join()
            self._allocating = None
            waited = time.perf_counter() - waited
            if self._allocated is not None:
                print_fn(
                    self._allocated
                    + (f"; the save waited {waited:.1f} s for them" if waited >= 0.1 else "")
                )
        staged = {}
        pin = torch.cuda.is_available()
        for name, chunked in tensors.items():
            copies = []
            for offsets, tensor in chunked.chunks:
                buffer = self._buffers.get((name, offsets))
                if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                    key = (name, offsets)
                    buffer = allocate_host_buffers({key: (tensor.shape, tensor.dtype)}, pin)
                    buffer = self._buffers[key] = buffer.tensors[key]
                buffer.copy_(tensor, non_blocking=pin)
                copies.append((offsets, buffer))
            staged[name] = ChunkedTensor(chunked.global_shape, copies)
        if pin:
            torch.cuda.synchronize()
        return staged

    def start(self, write: Callable[[], Optional[str]], description: str) -> None:
        """Run `write` (returning None or a failure's message) in the background; `description`
        names the checkpoint in the line `wait` prints. Call `wait` first: the buffers that
        `stage` filled must not be refilled while a write reads them."""
        if self.busy:
            raise RuntimeError("a checkpoint write is still running; wait() for it first")
        started = time.perf_counter()

        def run() -> None:
            _yield_to_training()
            try:
                self._outcome = write()
            except BaseException as error:  # reported by wait() on the training thread
                self._outcome = f"{description}: the background write failed: {error!r}"
            seconds = time.perf_counter() - started
            self._done_message = f"{description} (written in the background in {seconds:.1f} s)"

        self._outcome, self._done_message = None, None
        self._thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Whether a write is still running."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self, print_fn: Callable[[str], None] = print) -> None:
        """Join the running write, if any; print its completion line, or raise CheckpointError
        with its failure (on every rank: the write ends with a collective outcome)."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        if self._outcome is not None:
            raise CheckpointError(self._outcome)
        print_fn(self._done_message)


def _yield_to_training() -> None:
    """Lower this thread's scheduling priority (and so that of the threads it starts, which
    hash the files): where cores are short, the training thread runs first."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass
