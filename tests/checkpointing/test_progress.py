"""The checkpoint tools' progress bars (megatron.checkpointing.progress): shown on a terminal,
silent on a pipe or in a file; the safetensors reads and writes of Hugging Face export and
import report their bytes through them."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import struct
import sys
import termios

import pytest
import torch

from megatron.checkpointing.progress import batches_by_bytes, progress_bar


def _terminal_output(work) -> str:
    """What `work()` writes to standard error when standard error is a terminal."""
    controller, terminal = pty.openpty()
    # A terminal of 24 x 120 characters (a fresh pseudo-terminal has none, and no room for a bar).
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    os.set_blocking(controller, False)
    stream = os.fdopen(terminal, "w")
    saved, sys.stderr = sys.stderr, stream
    chunks = []
    try:
        work()
        stream.flush()
        while True:  # drained while the terminal is open: its buffered output stays readable
            try:
                chunks.append(os.read(controller, 65536))
            except BlockingIOError:
                break
    finally:
        sys.stderr = saved
        stream.close()
        os.close(controller)
    return b"".join(chunks).decode(errors="replace")


def _count_to_ten() -> None:
    with progress_bar("counting", 10, "tensor") as bar:
        for _ in range(10):
            bar.update(1)


def test_the_bar_shows_on_a_terminal_only():
    assert "counting" in _terminal_output(_count_to_ten)
    not_a_terminal = io.StringIO()
    with progress_bar("counting", 10, "tensor", file=not_a_terminal) as bar:
        bar.update(10)
    assert not_a_terminal.getvalue() == ""


def test_batches_by_bytes_keep_order_and_put_a_large_item_alone():
    items = [("a", 3), ("b", 3), ("c", 10), ("d", 1), ("e", 1)]
    assert list(batches_by_bytes(items, 6)) == [(["a", "b"], 6), (["c"], 10), (["d", "e"], 2)]


def test_safetensors_writes_and_reads_report_their_bytes(tmp_path, capsys):
    pytest.importorskip("safetensors")
    from gpt_pretraining.huggingface.hf_files import read_safetensors, write_safetensors

    tensors = {f"layer{i}.weight": torch.full((64, 64), float(i)) for i in range(4)}
    output = _terminal_output(
        lambda: write_safetensors(str(tmp_path), tensors, torch.bfloat16, print_fn=lambda _: None)
    )
    assert f"writing {tmp_path}" in output and "32.8k" in output  # 4 x 64 x 64 x 2 bytes
    read = {}
    assert f"reading {tmp_path}" in _terminal_output(
        lambda: read.update(read_safetensors(str(tmp_path)))
    )
    assert read.keys() == tensors.keys()
    # Off a terminal (pytest captures standard error): nothing.
    write_safetensors(str(tmp_path), tensors, print_fn=lambda _: None)
    read_safetensors(str(tmp_path))
    assert capsys.readouterr().err == ""


class _Counter:
    """What the writers need of a bar: `update(bytes)`."""

    def __init__(self) -> None:
        self.total = 0

    def update(self, count: int) -> None:
        self.total += count


def _state():
    return {"model": {f"w{i}": torch.randn(256, 64) for i in range(3)}, "iteration": 7}


def test_a_torch_format_save_counts_the_bytes_it_writes(tmp_path):
    from megatron.checkpointing.progress import tensor_bytes
    from megatron.checkpointing.save import write_torch_checkpoint

    counter = _Counter()
    path = write_torch_checkpoint(str(tmp_path), 7, _state(), progress=counter)
    assert counter.total == os.path.getsize(path)  # every byte torch.save wrote
    assert tensor_bytes(_state()) <= counter.total < 1.1 * tensor_bytes(_state())


def test_a_sharded_save_counts_its_tensors_bytes(tmp_path):
    from megatron.checkpointing.chunks import ChunkedTensor
    from megatron.checkpointing.sharded_save import write_sharded_checkpoint

    tensors = {name: ChunkedTensor(t.shape, [((0, 0), t)]) for name, t in _state()["model"].items()}
    counter = _Counter()
    assert write_sharded_checkpoint(str(tmp_path), 7, tensors, {}, None, progress=counter) is None
    assert counter.total == 3 * 256 * 64 * 4
