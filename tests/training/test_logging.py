"""Megatron's log formats that users' scripts parse."""

import torch

from megatron.training.logging import format_memory_report


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
