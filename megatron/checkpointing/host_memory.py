"""Host buffers for `--async-save`: one allocation, resident and page-locked before first use.

A save copies this rank's chunks from the GPU into these buffers while training waits, so they
are page-locked (a copy into pageable memory goes through the driver's staging at a fraction of
the rate) and allocated once, in the background, before the first save. Page-locking
(`cudaHostRegister`) holds the CUDA driver's lock, and the training thread's CUDA calls wait
for it meanwhile, so what matters is how long it takes (bench/host_buffers.py; its table in
docs/benchmark-log.md, "Checkpoint formats: notes"):

- registering pages that are not yet resident faults them in under that lock, several times
  slower than registering resident ones;
- one thread faults pages in at a fraction of what several reach;

so the pages are first written by several threads, outside the lock, on transparent huge pages
where the kernel allows them (fewer faults, faster registration), and only then registered, in
pieces of whole tensors so that no copy spans two registrations. Where registration is not
possible the buffers stay pageable (copies into them are then synchronous).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, Hashable, List, Tuple

import torch

# Bytes page-locked per registration at most; a piece holds whole tensors.
PIN_PIECE = 1 << 30
_PAGE = 4096
_HUGE_PAGE = 2 << 20
_ALIGNMENT = 64
# Bytes one thread writes per task while making the pages resident.
_WRITE_PIECE = 64 << 20


@dataclass
class HostBuffers:
    """Host tensors by key (views of one allocation), their bytes, and how long it took to
    make the pages resident and to page-lock them (0 when not pinned)."""

    tensors: Dict[Hashable, torch.Tensor]
    nbytes: int
    write_seconds: float = 0.0
    lock_seconds: float = 0.0

    def describe(self) -> str:
        """A log line's account of the allocation."""
        text = f"{self.nbytes / 1e9:.2f} GB of host buffers"
        if self.lock_seconds:
            text += (
                f" page-locked (pages written in {self.write_seconds:.1f} s, registered in "
                f"{self.lock_seconds:.1f} s)"
            )
        return text


def allocate_host_buffers(
    shapes: Dict[Hashable, Tuple[torch.Size, torch.dtype]], pin: bool
) -> HostBuffers:
    """Host tensors of `shapes`, views of one allocation of exactly the bytes needed (torch's
    pinned allocator would round each tensor up to a power of two), page-locked when `pin`."""
    sizes = {
        key: torch.Size(shape).numel() * dtype.itemsize for key, (shape, dtype) in shapes.items()
    }
    offsets, pieces, total = {}, [], 0
    for key, size in sizes.items():
        total = -(-total // _ALIGNMENT) * _ALIGNMENT
        if not pieces or total - pieces[-1][0] + size > PIN_PIECE:
            total = -(-total // _PAGE) * _PAGE
            pieces.append([total, 0])
        offsets[key] = total
        total += size
        pieces[-1][1] = total - pieces[-1][0]
    storage = torch.empty(max(total, 1), dtype=torch.uint8)
    buffers = HostBuffers(
        {
            key: storage[offsets[key] : offsets[key] + sizes[key]].view(dtype).view(shape)
            for key, (shape, dtype) in shapes.items()
        },
        total,
    )
    if pin:
        started = time.perf_counter()
        _advise_huge_pages(storage)
        _write_pages(storage)
        written = time.perf_counter()
        if _pin(storage, pieces):
            buffers.write_seconds = written - started
            buffers.lock_seconds = time.perf_counter() - written
    return buffers


def writing_threads() -> int:
    """Threads that fault the buffers' pages in: enough to reach the memory's rate, half the
    cores at most (training goes on beside them)."""
    return max(1, min(8, (os.cpu_count() or 1) // 2))


def _write_pages(storage: torch.Tensor) -> None:
    """Make every page of `storage` resident; ctypes releases the GIL for each memset."""
    address, size = storage.data_ptr(), storage.numel()

    def write(start: int) -> None:
        ctypes.memset(address + start, 0, min(_WRITE_PIECE, size - start))

    with ThreadPoolExecutor(writing_threads()) as pool:
        list(pool.map(write, range(0, size, _WRITE_PIECE)))


def _advise_huge_pages(storage: torch.Tensor) -> None:
    """Ask Linux for transparent huge pages under `storage` (before its pages are faulted in);
    elsewhere, or where the kernel refuses, nothing changes."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or not sys.platform.startswith("linux"):
        return
    start = -(-storage.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (storage.data_ptr() + storage.numel()) // _HUGE_PAGE * _HUGE_PAGE
    if end <= start:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice)
    except (OSError, AttributeError):
        return


def _pin(storage: torch.Tensor, pieces: List[List[int]]) -> bool:
    """Page-lock the byte ranges `pieces` ([start, length]) of `storage` (cudaHostRegister);
    whether all of them were."""
    try:
        cudart = torch.cuda.cudart()
        for start, length in pieces:
            if length and int(cudart.cudaHostRegister(storage.data_ptr() + start, length, 0)):
                return False
    except (AttributeError, RuntimeError, AssertionError):
        return False
    return True
