"""--ckpt-format torch_dist in one process: exact resume, checksums, asynchronous saves,
retention, and the chunk geometry every layout relies on. The layouts themselves (TP, PP, EP,
DP, the distributed optimizer) save and resume through this format in the multi-process tests
of tests/parallel/, tests/pipeline/, tests/moe/ and tests/optimizer/."""

from __future__ import annotations

import argparse
import errno
import os
import random
from dataclasses import replace

import pytest
import torch

from megatron.checkpointing import CheckpointError, load_checkpoint, save_checkpoint, sharded_save
from megatron.checkpointing.async_save import AsyncCheckpointWriter
from megatron.checkpointing.chunks import flat_range_rectangles
from megatron.checkpointing.load import read_checkpoint_args
from tests.checkpointing.helpers import (
    assert_optimizer_states_equal,
    assert_state_dicts_equal,
    build,
    checkpoint_config,
    train,
)


def sharded_config(directory, **flags):
    return checkpoint_config(directory, ckpt_format="torch_dist", **flags)


def test_round_trip_resumes_training_exactly(tmp_path):
    args = argparse.Namespace(num_layers=2)
    model, optimizer, scheduler = build(seed=1)
    train(model, optimizer, scheduler, 3)
    save_checkpoint(
        sharded_config(tmp_path), 3, model, optimizer, scheduler, args=args,
        consumed_train_samples=24, consumed_valid_samples=4,
    )  # fmt: skip
    train(model, optimizer, scheduler, 2)  # what the saving run does next

    resumed_model, resumed_optimizer, resumed_scheduler = build(seed=99)
    loaded = load_checkpoint(
        sharded_config(tmp_path), resumed_model, resumed_optimizer, resumed_scheduler
    )
    assert loaded.iteration == 3 and loaded.loaded_from == str(tmp_path / "iter_0000003")
    assert (loaded.consumed_train_samples, loaded.consumed_valid_samples) == (24, 4)
    train(resumed_model, resumed_optimizer, resumed_scheduler, 2)
    assert_state_dicts_equal(model.state_dict(), resumed_model.state_dict())
    assert_optimizer_states_equal(optimizer.state_dict(), resumed_optimizer.state_dict())
    assert resumed_scheduler.num_steps == scheduler.num_steps == 5
    assert read_checkpoint_args(str(tmp_path)).consumed_train_samples == 24
    files = sorted(os.listdir(tmp_path / "iter_0000003"))
    assert files == [
        ".metadata", "__0_0.distcp", "checksums.json", "common.pt", "metadata.json"
    ]  # fmt: skip


def test_either_format_loads_whatever_the_flag_says(tmp_path):
    model, optimizer, scheduler = build(seed=1)
    train(model, optimizer, scheduler, 1)
    for ckpt_format in ("torch", "torch_dist"):
        directory = tmp_path / ckpt_format
        save_checkpoint(
            checkpoint_config(directory, ckpt_format=ckpt_format), 1, model, optimizer, scheduler
        )
        for reading_flag in ("torch", "torch_dist"):
            fresh, fresh_optimizer, fresh_scheduler = build(seed=2)
            config = checkpoint_config(directory, ckpt_format=reading_flag)
            load_checkpoint(config, fresh, fresh_optimizer, fresh_scheduler)
            assert_state_dicts_equal(model.state_dict(), fresh.state_dict())
            assert_optimizer_states_equal(optimizer.state_dict(), fresh_optimizer.state_dict())


def test_no_load_optim_and_finetune(tmp_path):
    model, optimizer, scheduler = build(seed=1)
    train(model, optimizer, scheduler, 2)
    save_checkpoint(sharded_config(tmp_path, no_save_optim=True), 2, model, optimizer, scheduler)
    fresh, fresh_optimizer, fresh_scheduler = build(seed=3)
    with pytest.raises(CheckpointError, match="pass --no-load-optim or --finetune"):
        load_checkpoint(sharded_config(tmp_path), fresh, fresh_optimizer, fresh_scheduler)
    loaded = load_checkpoint(
        sharded_config(tmp_path, no_load_optim=True), fresh, fresh_optimizer, fresh_scheduler
    )
    assert loaded.iteration == 2 and not fresh_optimizer.state
    assert_state_dicts_equal(model.state_dict(), fresh.state_dict())
    loaded = load_checkpoint(sharded_config(tmp_path, finetune=True), *build(seed=4))
    assert loaded.iteration == 0


def test_a_damaged_or_missing_file_is_named_with_the_previous_checkpoint(tmp_path):
    model, optimizer, scheduler = build(seed=1)
    for iteration in (1, 2):
        train(model, optimizer, scheduler, 1)
        save_checkpoint(sharded_config(tmp_path), iteration, model, optimizer, scheduler)
    path = tmp_path / "iter_0000002" / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{path} is damaged: bytes .*echo 1 > "):
        load_checkpoint(sharded_config(tmp_path), *build())
    path.unlink()
    with pytest.raises(CheckpointError, match=f"{path} is missing .*echo 1 > "):
        load_checkpoint(sharded_config(tmp_path), *build())


def test_async_save_holds_the_state_at_the_save(tmp_path):
    """Training goes on while the background write runs; the checkpoint holds the copy."""
    model, optimizer, scheduler = build(seed=1)
    train(model, optimizer, scheduler, 2)
    saved_model = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    writer = AsyncCheckpointWriter()
    save_checkpoint(sharded_config(tmp_path), 2, model, optimizer, scheduler, async_writer=writer)
    train(model, optimizer, scheduler, 2)
    lines = []
    writer.wait(lines.append)
    assert lines and "written in the background in" in lines[0]
    fresh, fresh_optimizer, fresh_scheduler = build(seed=5)
    assert load_checkpoint(sharded_config(tmp_path), fresh, fresh_optimizer, fresh_scheduler)
    assert_state_dicts_equal(saved_model, fresh.state_dict())
    assert fresh_scheduler.num_steps == 2


def test_a_failed_background_write_is_raised_and_keeps_the_previous(tmp_path, monkeypatch):
    model, optimizer, scheduler = build(seed=1)
    save_checkpoint(sharded_config(tmp_path), 1, model, optimizer, scheduler)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x.distcp"))

    monkeypatch.setattr(sharded_save, "write_sharded_files", full_disk)
    writer = AsyncCheckpointWriter()
    save_checkpoint(sharded_config(tmp_path), 2, model, optimizer, scheduler, async_writer=writer)
    with pytest.raises(CheckpointError, match="No space left on device .ENOSPC. writing .*"
                       "the latest checkpoint is still iteration 1"):  # fmt: skip
        writer.wait()
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch"])
def test_keep_latest_checkpoints_deletes_older_ones_after_a_newer_is_complete(
    tmp_path, ckpt_format
):
    model, optimizer, scheduler = build(seed=1)
    config = checkpoint_config(tmp_path, ckpt_format=ckpt_format, keep_latest_checkpoints=2)
    for iteration in (1, 2, 3, 4):
        save_checkpoint(config, iteration, model, optimizer, scheduler)
    assert sorted(os.listdir(tmp_path)) == [
        "iter_0000003", "iter_0000004", "latest_checkpointed_iteration.txt"
    ]  # fmt: skip
    # A run resumed from an older checkpoint leaves the newer iteration 4 alone until it
    # replaces it.
    os.rename(tmp_path / "iter_0000003", tmp_path / "iter_0000002")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    save_checkpoint(replace(config, keep_latest_checkpoints=1), 3, model, optimizer, scheduler)
    assert sorted(os.listdir(tmp_path)) == [
        "iter_0000003", "iter_0000004", "latest_checkpointed_iteration.txt"
    ]  # fmt: skip


def test_flat_ranges_are_contiguous_rectangles_that_tile_them():
    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        numel = int(torch.tensor(shape).prod())
        start = rng.randint(0, numel - 1)
        end = rng.randint(start + 1, numel)
        flat = torch.arange(numel).view(shape)
        covered = []
        rectangles = flat_range_rectangles(shape, start, end)
        assert len(rectangles) <= 2 * len(shape) - 1
        for offsets, sizes in rectangles:
            block = flat[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
            values = block.reshape(-1).tolist()
            assert values == list(range(values[0], values[0] + len(values)))  # contiguous
            covered += values
        assert covered == list(range(start, end)), (shape, start, end, rectangles)


def test_an_old_checkpoint_that_cannot_be_deleted_does_not_fail_the_save(tmp_path, monkeypatch):
    model, optimizer, scheduler = build(seed=1)
    config = sharded_config(tmp_path, keep_latest_checkpoints=1)
    save_checkpoint(config, 1, model, optimizer, scheduler)
    replace_directory = os.replace

    def refuse_to_move_iteration_1(source, destination):
        if str(source).endswith("iter_0000001"):
            raise PermissionError(errno.EACCES, "Permission denied", str(source))
        return replace_directory(source, destination)

    monkeypatch.setattr(os, "replace", refuse_to_move_iteration_1)
    save_checkpoint(config, 2, model, optimizer, scheduler)
    assert sorted(os.listdir(tmp_path)) == [
        "iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt"
    ]  # fmt: skip
