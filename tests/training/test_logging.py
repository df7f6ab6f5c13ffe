"""Megatron's log formats that users' scripts parse, and the one-time torch.compile report."""

import torch

from megatron.training.logging import format_compile_report, format_memory_report


def test_memory_report_is_megatrons_line(monkeypatch):
    mib = 1024 * 1024
    readings = {
        "memory_allocated": 1536 * mib,
        "max_memory_allocated": 2048 * mib,
        "memory_reserved": 3072 * mib,
        "max_memory_reserved": 4096 * mib,
    }
    for name, value in readings.items():
        monkeypatch.setattr(torch.cuda, name, lambda device, value=value: value)
    line = format_memory_report(rank=3, iteration=100, device=torch.device("cuda", 0))
    assert line == (
        "[Rank 3] (after 100 iterations) memory (MB) | allocated: 1536.0 | max allocated: 2048.0"
        " | reserved: 3072.0 | max reserved: 4096.0"
    )


def test_the_compile_report_counts_what_torch_compile_captured():
    """Nothing compiled: no line. A function compiled with one graph break: two graphs (its
    halves) and the break, counted where dynamo counts them (the GPU layout tests read this
    line to know that a run they call compiled was)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert format_compile_report(1) is None

    def halves(x):
        y = x.sin()
        torch._dynamo.graph_break()
        return y.cos()

    compiled = torch.compile(halves, backend="eager")
    x = torch.randn(4)
    torch.testing.assert_close(compiled(x), halves(x))
    assert format_compile_report(2) == (
        "> torch.compile (after 2 iterations): 2 graphs, 1 graph breaks"
    )
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
