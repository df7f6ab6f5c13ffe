"""Checksums recorded while a checkpoint is written, and verified before it is loaded."""

from __future__ import annotations

import hashlib
import io
import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megatron.checkpointing import CheckpointError, checkpoint_file, load_checkpoint
from megatron.checkpointing.checksums import (
    ChecksumWriter,
    FileChecksum,
    find_damage,
    read_manifest,
)
from megatron.checkpointing.save import save_checkpoint
from tests.checkpointing.helpers import build, checkpoint_config, train


def _blocks(data: bytes, block_size: int) -> list:
    return [
        hashlib.sha256(data[start : start + block_size]).hexdigest()
        for start in range(0, len(data), block_size)
    ]


@pytest.mark.parametrize("write_sizes", [[1] * 40, [7, 3, 30], [64], [5, 50, 9], [16, 16, 32]])
def test_blocks_do_not_depend_on_how_the_bytes_were_written(write_sizes):
    data = os.urandom(sum(write_sizes))
    sink = io.BytesIO()
    with ThreadPoolExecutor(3) as pool:
        writer = ChecksumWriter(sink, pool, block_size=16)
        position = 0
        for size in write_sizes:
            assert writer.write(memoryview(data)[position : position + size]) == size
            position += size
        checksum = writer.finish()
    assert sink.getvalue() == data
    assert checksum == FileChecksum(len(data), _blocks(data, 16))


def test_torch_save_through_the_writer_is_the_same_file(tmp_path):
    state = {"weights": torch.randn(1000, 37), "step": 3}
    reference = io.BytesIO()
    torch.save(state, reference)
    with open(tmp_path / "file.pt", "wb") as file, ThreadPoolExecutor(2) as pool:
        writer = ChecksumWriter(file, pool, block_size=4096)
        torch.save(state, writer)
        checksum = writer.finish()
    written = (tmp_path / "file.pt").read_bytes()
    assert written == reference.getvalue()
    assert checksum == FileChecksum(len(written), _blocks(written, 4096))
    assert find_damage(str(tmp_path / "file.pt"), checksum, 4096) is None


def test_damage_names_the_first_damaged_bytes(tmp_path):
    path = tmp_path / "file.bin"
    data = os.urandom(10_000)
    path.write_bytes(data)
    checksum = FileChecksum(len(data), _blocks(data, 1024))
    with open(path, "r+b") as file:
        file.seek(3000)
        file.write(b"\0" * 2000)
    assert find_damage(str(path), checksum, 1024) == (
        "bytes 2048-3071 differ from what was written (3 of 10 blocks differ)"
    )
    path.write_bytes(data[:-1])
    assert find_damage(str(path), checksum, 1024) == "it is 9999 bytes, but 10000 were written"


def _save(directory, iteration, model, optimizer, scheduler):
    save_checkpoint(checkpoint_config(directory), iteration, model, optimizer, scheduler)


def _overwrite_middle(path: str, length: int) -> None:
    with open(path, "r+b") as file:
        file.seek(os.path.getsize(path) // 2)
        file.write(os.urandom(length))


def test_a_checkpoint_overwritten_in_the_middle_is_refused_naming_the_previous_one(tmp_path):
    model, optimizer, scheduler = build()
    _save(tmp_path, 1, model, optimizer, scheduler)
    train(model, optimizer, scheduler, 1)
    _save(tmp_path, 2, model, optimizer, scheduler)
    manifest = read_manifest(str(tmp_path / "iter_0000002"))
    assert list(manifest.files) == [os.path.join("mp_rank_00", "model_optim_rng.pt")]
    path = checkpoint_file(str(tmp_path), 2)
    _overwrite_middle(path, 4 << 10)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(checkpoint_config(tmp_path), *build(seed=5))
    message = str(error.value)
    assert "\n" not in message
    assert f"checkpoint file {path} is damaged: bytes " in message
    assert message.endswith(
        f"point {tmp_path}/latest_checkpointed_iteration.txt at the previous checkpoint, "
        f"iteration 1: echo 1 > {tmp_path}/latest_checkpointed_iteration.txt"
    )
    # Following the advice resumes from iteration 1.
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    assert load_checkpoint(checkpoint_config(tmp_path), *build(seed=5)).iteration == 1


def test_checkpoints_without_checksums_load_with_a_note(tmp_path, capsys):
    model, optimizer, scheduler = build()
    _save(tmp_path, 1, model, optimizer, scheduler)
    os.remove(tmp_path / "iter_0000001" / "checksums.json")
    assert load_checkpoint(checkpoint_config(tmp_path), *build(seed=5)).iteration == 1
    assert "has no checksums.json" in capsys.readouterr().out


def test_a_garbled_checksum_file_is_named(tmp_path):
    model, optimizer, scheduler = build()
    _save(tmp_path, 1, model, optimizer, scheduler)
    manifest = tmp_path / "iter_0000001" / "checksums.json"
    manifest.write_text(manifest.read_text()[:40])
    with pytest.raises(CheckpointError, match="checksums.json is unreadable .* delete checksums"):
        load_checkpoint(checkpoint_config(tmp_path), *build(seed=5))


def test_saving_without_checksums_writes_the_same_checkpoint(tmp_path):
    model, optimizer, scheduler = build()
    save_checkpoint(checkpoint_config(tmp_path / "a"), 1, model, optimizer, scheduler)
    save_checkpoint(
        checkpoint_config(tmp_path / "b"), 1, model, optimizer, scheduler, checksums=False
    )
    with_checksums = open(checkpoint_file(str(tmp_path / "a"), 1), "rb").read()
    without = open(checkpoint_file(str(tmp_path / "b"), 1), "rb").read()
    assert len(with_checksums) == len(without)
    assert not (tmp_path / "b" / "iter_0000001" / "checksums.json").exists()
    recorded = json.loads((tmp_path / "a" / "iter_0000001" / "checksums.json").read_text())
    entry = recorded["files"][os.path.join("mp_rank_00", "model_optim_rng.pt")]
    assert entry["size"] == len(with_checksums)
    assert entry["blocks"] == _blocks(with_checksums, recorded["block_size"])
