"""What page-locking the `--async-save` host buffers costs a training thread, per strategy.

A background thread page-locks GB gigabytes of host memory (`cudaHostRegister`) while the main
thread runs GPU work and times it: bf16 matrix products (GPU-bound) and bursts of small kernels
(launch-bound), alternating, each synchronized. The table gives the time to page-lock, the
main thread's time lost meanwhile (the rounds of each kind that ran during it, against as many
at their median time before it: a median alone hides a stall shorter than the window), and the
GPU-to-host copy rate into the buffer once locked (the time a save blocks training per GB).
Strategies:

- `1 GiB pieces`: what `megatron.checkpointing.async_save` did first: plain memory registered in
  pieces of 1 GiB, its pages first touched by the registration;
- `prefault, 1 GiB pieces`: the pages first written (`fill_`, which releases the GIL), then
  registered;
- `huge pages, prefault, ...`: the memory mapped anonymously with `madvise(MADV_HUGEPAGE)`
  (transparent huge pages), written, then registered;
- `..., 64 MiB pieces, paced`: smaller registrations with a pause of PACE times each one's
  duration after it, so the driver serves the main thread's calls in between;
- `pageable`: no registration (copies into pageable memory go through the driver's staging).

    python -m bench.host_buffers --gigabytes 16
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import threading
import time
from typing import Callable, List, Optional, Tuple

import torch

GIB = 1 << 30
MIB = 1 << 20


def anonymous_memory(size: int, huge_pages: bool) -> Tuple[torch.Tensor, Optional[mmap.mmap]]:
    """`size` bytes of host memory as a uint8 tensor (and the mapping that owns it, if any)."""
    if not huge_pages:
        return torch.empty(size, dtype=torch.uint8), None
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.uint8), mapping


def register(tensor: torch.Tensor, piece: int, pace: float) -> float:
    """Page-lock `tensor` in pieces of `piece` bytes, pausing `pace` x each piece's duration
    after it; returns the seconds spent."""
    cudart = torch.cuda.cudart()
    start = time.perf_counter()
    pointer, size = tensor.data_ptr(), tensor.numel()
    for offset in range(0, size, piece):
        began = time.perf_counter()
        code = cudart.cudaHostRegister(pointer + offset, min(piece, size - offset), 0)
        if int(code) != 0:
            raise RuntimeError(f"cudaHostRegister failed: {code}")
        if pace:
            time.sleep(pace * (time.perf_counter() - began))
    return time.perf_counter() - start


def unregister(tensor: torch.Tensor, piece: int) -> None:
    cudart = torch.cuda.cudart()
    for offset in range(0, tensor.numel(), piece):
        cudart.cudaHostUnregister(tensor.data_ptr() + offset)


def gpu_work_times(stop: Callable[[], bool], minimum: float) -> Tuple[List[float], List[float]]:
    """Alternate timed rounds of matrix products and of small kernels until `stop()` (and at
    least `minimum` seconds); the seconds of each round of each kind."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    small = torch.zeros(1024, device="cuda")
    products, launches = [], []
    end = time.perf_counter() + minimum
    while time.perf_counter() < end or not stop():
        began = time.perf_counter()
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
        products.append(time.perf_counter() - began)
        began = time.perf_counter()
        for _ in range(200):
            small.add_(1)
        torch.cuda.synchronize()
        launches.append(time.perf_counter() - began)
    return products, launches


def copy_rate(host: torch.Tensor, piece: int) -> float:
    """GB/s of a GPU-to-host copy of 4 GiB (or the buffer's size) into `host`, in copies of at
    most `piece` bytes (one copy must not span two registrations)."""
    size = min(4 * GIB, host.numel())
    device = torch.empty(size, dtype=torch.uint8, device="cuda").random_(0, 255)

    def copy() -> float:
        torch.cuda.synchronize()
        began = time.perf_counter()
        for offset in range(0, size, piece):
            end = min(offset + piece, size)
            host[offset:end].copy_(device[offset:end], non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - began

    copy()
    return size / copy() / 1e9


def measure(size: int, huge_pages: bool, prefault: bool, piece: int, pace: float, lock: bool):
    host, mapping = anonymous_memory(size, huge_pages)
    seconds = [0.0]
    if prefault:
        host.fill_(0)

    def work(buffer: torch.Tensor) -> None:
        if lock:
            seconds[0] = register(buffer, piece, pace)

    baseline = gpu_work_times(lambda: True, 3.0)
    thread = threading.Thread(target=work, args=(host,))
    thread.start()
    during = gpu_work_times(lambda: not thread.is_alive(), 0.5)
    thread.join()
    rate = copy_rate(host, piece)
    if lock:
        unregister(host, piece)
    del host, mapping
    lost = [
        sum(after) - len(after) * statistics.median(before)
        for before, after in zip(baseline, during)
    ]
    return seconds[0], lost[0], lost[1], rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gigabytes", type=float, default=16.0)
    parser.add_argument("--pace", type=float, default=4.0)
    args = parser.parse_args()
    size = int(args.gigabytes * GIB)
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as file:
            print(f"transparent huge pages: {file.read().strip()}")
    except OSError:
        print("transparent huge pages: unknown")
    strategies = [
        ("1 GiB pieces", False, False, GIB, 0.0, True),
        ("prefault, 1 GiB pieces", False, True, GIB, 0.0, True),
        ("huge pages, prefault, 1 GiB pieces", True, True, GIB, 0.0, True),
        ("huge pages, prefault, 64 MiB pieces, paced", True, True, 64 * MIB, args.pace, True),
        ("prefault, 64 MiB pieces, paced", False, True, 64 * MIB, args.pace, True),
        ("pageable", False, True, GIB, 0.0, False),
    ]
    rows = []
    for name, huge, prefault, piece, pace, lock in strategies:
        seconds, products, launches, rate = measure(size, huge, prefault, piece, pace, lock)
        rows.append((name, seconds, products, launches, rate))
        print(
            f"{name}: {seconds:.2f} s, lost {products:.2f} s of products and {launches:.2f} s "
            f"of launches, copy {rate:.1f} GB/s",
            flush=True,
        )
    print(f"\n{args.gigabytes:g} GiB, pace {args.pace:g}")
    print(
        f"{'strategy':<46} {'lock s':>7} {'GB/s locked':>12} {'products lost s':>16} "
        f"{'launches lost s':>16} {'copy GB/s':>10}"
    )
    for name, seconds, products, launches, rate in rows:
        locked = size / seconds / 1e9 if seconds else float("nan")
        print(
            f"{name:<46} {seconds:7.2f} {locked:12.2f} {products:16.2f} {launches:16.2f} "
            f"{rate:10.1f}"
        )


if __name__ == "__main__":
    main()
