"""`--async-save`: training waits only while the state is copied to host memory.

`AsyncCheckpointWriter.start` copies this rank's chunks (megatron.checkpointing.sharded_state)
into host buffers, pinned when a GPU is present and kept for the next save, and hands the
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
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from megatron.checkpointing.chunks import ChunkedTensor, Offsets
from megatron.checkpointing.layout import CheckpointError
from megatron.checkpointing.sharded_save import sharded_tensors


class AsyncCheckpointWriter:
    """One background checkpoint write at a time, and the host buffers it reuses."""

    def __init__(self) -> None:
        self._buffers: Dict[Tuple[str, Offsets], torch.Tensor] = {}
        self._allocating: Optional[threading.Thread] = None
        self._thread: Optional[threading.Thread] = None
        self._outcome: Optional[str] = None
        self._done_message: Optional[str] = None

    def prepare(self, model: nn.Module, optimizer: Any) -> None:
        """Allocate the host buffers for the chunks of `model` and `optimizer` (None: not saved)
        in the background, once, so that the first save does not block training while tens of
        GB are page-locked (the iterations the locking overlaps still slow down: the driver
        serves their calls between its pieces). Call it once the optimizer has its state."""
        if self._allocating is not None or self._buffers:
            return
        shapes = {
            (name, offsets): (tensor.shape, tensor.dtype)
            for name, chunked in sharded_tensors(model, optimizer).items()
            for offsets, tensor in chunked.chunks
        }

        def allocate() -> None:
            self._buffers.update(_host_buffers(shapes, pin=torch.cuda.is_available()))

        self._allocating = threading.Thread(target=allocate, name="checkpoint-buffers", daemon=True)
        self._allocating.start()

    def stage(self, tensors: Dict[str, ChunkedTensor]) -> Dict[str, ChunkedTensor]:
        """Host copies of `tensors`, in buffers kept from the previous save (or `prepare`d)
        when they fit."""
        if self._allocating is not None:
            self._allocating.join()
            self._allocating = None
        staged = {}
        pin = torch.cuda.is_available()
        for name, chunked in tensors.items():
            copies = []
            for offsets, tensor in chunked.chunks:
                buffer = self._buffers.get((name, offsets))
                if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                    key = (name, offsets)
                    buffer = _host_buffers({key: (tensor.shape, tensor.dtype)}, pin)[key]
                    self._buffers[key] = buffer
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


# Bytes pinned per registration at most: between pieces the driver serves the training
# thread's calls. A piece holds whole tensors, so a copy never spans two registrations.
_PIN_PIECE = 1 << 30
_PAGE = 4096
_ALIGNMENT = 64


def _host_buffers(
    shapes: Dict[Tuple[str, Offsets], Tuple[torch.Size, torch.dtype]], pin: bool
) -> Dict[Tuple[str, Offsets], torch.Tensor]:
    """Host tensors of `shapes`, views of one allocation, page-locked when `pin` (and the
    runtime can register host memory): exactly the bytes needed, where torch's pinned
    allocator rounds each tensor up to a power of two."""
    sizes = {
        key: torch.Size(shape).numel() * dtype.itemsize for key, (shape, dtype) in shapes.items()
    }
    offsets, pieces, total = {}, [], 0
    for key, size in sizes.items():
        total = -(-total // _ALIGNMENT) * _ALIGNMENT
        if not pieces or total - pieces[-1][0] + size > _PIN_PIECE:
            total = -(-total // _PAGE) * _PAGE
            pieces.append([total, 0])
        offsets[key] = total
        total += size
        pieces[-1][1] = total - pieces[-1][0]
    storage = torch.empty(max(total, 1), dtype=torch.uint8)
    if pin:
        _pin(storage, pieces)
    return {
        key: storage[offsets[key] : offsets[key] + sizes[key]].view(dtype).view(shape)
        for key, (shape, dtype) in shapes.items()
    }


def _pin(storage: torch.Tensor, pieces: List[List[int]]) -> None:
    """Page-lock the byte ranges `pieces` ([start, length]) of `storage` (cudaHostRegister);
    what cannot be registered stays pageable (copies into it are then synchronous)."""
    try:
        cudart = torch.cuda.cudart()
        for start, length in pieces:
            if length:
                cudart.cudaHostRegister(storage.data_ptr() + start, length, 0)
    except (AttributeError, RuntimeError):
        return
