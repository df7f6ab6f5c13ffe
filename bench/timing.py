"""How the benchmarks time their calls: `median_ms` for one call, `capture_graph` and
`median_step_ms` for a step run alone or back to back.

`median_ms` has three clocks, one per kind of question:
- CUDA events around each call (the default): the GPU's time from the call's first launch to its
  last kernel's end, including any time the host leaves the GPU waiting between launches.
- CUDA-graph replays (`graph_calls`): the GPU's time alone, without the host's work between
  calls (for products small enough that the host's setup per call would set the pace).
- The wall clock (`wall_clock`), the GPU synchronized around each call where CUDA is in use:
  what the caller waits for, host overhead included; the one clock that also runs on a CPU.
"""

from __future__ import annotations

import time
from typing import Callable

import torch


def capture_graph(fn: Callable[[], object], calls: int = 1, warmup: int = 3) -> Callable[[], None]:
    """`calls` calls of `fn` captured as one CUDA graph, after `warmup` calls; its replay. Both
    run on a side stream, as torch's CUDA graph notes advise."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    return graph.replay


def median_step_ms(
    run: Callable[[], object], steps: int, rounds: int, idle_s: float = 0.0
) -> float:
    """Median over `rounds` of the mean ms per step of `steps` calls of `run` between two
    events. With steps=1 each step is timed alone, after the host's synchronization left the
    GPU idle (for `idle_s` more seconds, when given); with more, the steps run back to back,
    as a training loop runs them."""
    means = []
    for _ in range(rounds):
        if idle_s:
            time.sleep(idle_s)
        means.append(mean_step_ms(run, steps))
    means.sort()
    return means[len(means) // 2]


def mean_step_ms(run: Callable[[], object], steps: int) -> float:
    """The mean ms per step of `steps` calls of `run` back to back, between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def median_ms(
    fn: Callable[[], object],
    *,
    warmup: int = 5,
    repeats: int = 20,
    graph_calls: int = 0,
    wall_clock: bool = False,
) -> float:
    """The median ms of one call of `fn()` over `repeats` timings, after `warmup` calls.

    By default each call is timed alone between two CUDA events. With `graph_calls` N, N calls
    are captured as one CUDA graph (after `warmup` calls) and each timing is one replay divided
    by N. With `wall_clock`, each call is timed by the host's clock (see the module docstring).
    """
    if graph_calls and wall_clock:
        raise ValueError(
            f"median_ms: graph_calls={graph_calls} and wall_clock=True are two clocks; pick one"
        )
    if graph_calls:
        replay = capture_graph(fn, graph_calls, warmup)
        replay()
        torch.cuda.synchronize()
        return median_step_ms(replay, steps=1, rounds=repeats) / graph_calls
    for _ in range(warmup):
        fn()
    times = []
    if wall_clock:
        synchronize = torch.cuda.synchronize if torch.cuda.is_initialized() else lambda: None
        for _ in range(repeats):
            synchronize()
            start = time.perf_counter()
            fn()
            synchronize()
            times.append((time.perf_counter() - start) * 1e3)
    else:
        torch.cuda.synchronize()
        for _ in range(repeats):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]
