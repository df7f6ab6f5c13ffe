"""bench.timing.median_ms: how many calls each clock makes and what it returns; its GPU clocks
(CUDA events, graph replays) on a GPU."""

import time

import pytest
import torch

from bench.timing import median_ms
from tests.markers import gpu


class Calls:
    """A call that counts itself and, on the CPU, takes at least `sleep_s`."""

    def __init__(self, fn=None, sleep_s: float = 0.0):
        self.count, self.fn, self.sleep_s = 0, fn, sleep_s

    def __call__(self):
        self.count += 1
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self.fn() if self.fn is not None else None


def test_the_wall_clock_times_each_call_on_the_cpu():
    call = Calls(sleep_s=0.002)
    ms = median_ms(call, warmup=2, repeats=5, wall_clock=True)
    assert call.count == 2 + 5
    assert 2.0 <= ms < 1000.0


def test_one_clock_at_a_time():
    with pytest.raises(ValueError, match="graph_calls=4 and wall_clock=True"):
        median_ms(Calls(), graph_calls=4, wall_clock=True)


@gpu
def test_events_and_graph_replays_time_one_product():
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    call = Calls(lambda: a @ a)
    event_ms = median_ms(call, warmup=3, repeats=7)
    assert call.count == 3 + 7
    call.count = 0
    # The graph's calls run in Python once, while it is captured; its replays do not.
    graph_ms = median_ms(call, warmup=3, repeats=7, graph_calls=10)
    assert call.count == 3 + 10
    wall_ms = median_ms(call, warmup=3, repeats=7, wall_clock=True)
    # The three clocks agree within a factor of 3 on a product that keeps the GPU busy.
    for ms in (event_ms, graph_ms, wall_ms):
        assert 0.0 < ms < 3 * min(event_ms, graph_ms, wall_ms)
