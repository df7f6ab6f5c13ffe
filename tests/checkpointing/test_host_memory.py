"""The --async-save host buffers: resident before they are page-locked, whole tensors in each
registration, pageable when registration fails, and the line that says how they were made."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

from megatron.checkpointing import host_memory
from megatron.checkpointing.async_save import AsyncCheckpointWriter
from megatron.checkpointing.host_memory import allocate_host_buffers
from megatron.checkpointing.sharded_save import sharded_tensors
from tests.checkpointing.helpers import build, train

# Above glibc's largest mmap threshold, so each allocation is fresh, untouched memory.
SHAPES = {
    "embedding": (torch.Size([25, 1 << 20]), torch.float32),
    "experts": (torch.Size([15, 1 << 20]), torch.float32),
    "bias": (torch.Size([3]), torch.bfloat16),
}


def resident_fraction(address: int, length: int) -> float:
    """The share of the pages of [address, address + length) in memory (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = address // page * page
    end = -(-(address + length) // page) * page
    status = (ctypes.c_ubyte * ((end - start) // page))()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), status) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(byte & 1 for byte in status) / len(status)


class RecordingRuntime:
    """Stands in for torch.cuda.cudart() on a machine without a GPU: records each
    registration and how much of it was resident when it was asked for."""

    def __init__(self, code: int = 0):
        self.code = code
        self.registered = []

    def cudaHostRegister(self, address, length, flags):  # noqa: N802 (CUDA's name)
        self.registered.append((address, length, resident_fraction(address, length)))
        return self.code


@pytest.fixture
def runtime(monkeypatch):
    recording = RecordingRuntime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: recording)
    return recording


def test_pages_are_resident_before_they_are_page_locked(runtime):
    """Registering pages not yet faulted in stalls every CUDA call of the training thread."""
    buffers = allocate_host_buffers(SHAPES, pin=True)
    assert runtime.registered
    assert [fraction for _, _, fraction in runtime.registered] == [1.0] * len(runtime.registered)
    assert buffers.lock_seconds > 0 and buffers.write_seconds > 0


def test_each_registration_holds_whole_tensors(runtime, monkeypatch):
    """A copy must not span two registrations: every tensor lies inside one of them."""
    monkeypatch.setattr(host_memory, "PIN_PIECE", 64 << 20)
    buffers = allocate_host_buffers(SHAPES, pin=True)
    # The 100 MB tensor alone (a tensor larger than a piece is one piece), then 60 MB + 6 bytes.
    assert len(runtime.registered) == 2
    for tensor in buffers.tensors.values():
        start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.itemsize
        assert any(a <= start and end <= a + n for a, n, _ in runtime.registered)
    assert buffers.nbytes >= sum(t.numel() * t.itemsize for t in buffers.tensors.values())


def test_a_refused_registration_leaves_usable_pageable_buffers(monkeypatch):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: RecordingRuntime(code=1))
    buffers = allocate_host_buffers(SHAPES, pin=True)
    assert buffers.lock_seconds == 0.0
    assert "page-locked" not in buffers.describe()
    source = torch.randn(15, 1 << 20)
    buffers.tensors["experts"].copy_(source)
    assert torch.equal(buffers.tensors["experts"], source)


def test_the_first_save_says_how_its_buffers_were_made():
    model, optimizer, scheduler = build(seed=1)
    train(model, optimizer, scheduler, 1)
    writer = AsyncCheckpointWriter()
    writer.prepare(model, optimizer)
    lines = []
    tensors = sharded_tensors(model, optimizer)
    staged = writer.stage(tensors, lines.append)
    assert len(lines) == 1 and "GB of host buffers for --async-save ready in" in lines[0]
    writer.stage(tensors, lines.append)
    assert len(lines) == 1
    for name, chunked in tensors.items():
        for (_, original), (_, copy) in zip(chunked.chunks, staged[name].chunks):
            assert torch.equal(original, copy)
