"""A save cut off at any point leaves the tracker on the previous complete checkpoint."""

from __future__ import annotations

import os

import pytest

from megatron.checkpointing import (
    CheckpointError,
    checkpoint_file,
    load_checkpoint,
    save_checkpoint,
    tracker_file,
)
from tests.checkpointing.helpers import assert_state_dicts_equal, build, checkpoint_config, train


def save(directory, iteration, model, optimizer, scheduler):
    save_checkpoint(checkpoint_config(directory), iteration, model, optimizer, scheduler)


def fail_replace_into(monkeypatch, target_name):
    """Make os.replace raise when its destination is named `target_name`, as a crash would."""
    real_replace = os.replace

    def replace(source, destination):
        if os.path.basename(destination) == target_name:
            raise OSError(f"simulated crash before {destination} was written")
        real_replace(source, destination)

    monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize(
    "crash_at", ["latest_checkpointed_iteration.txt", "iter_0000002"], ids=["tracker", "rename"]
)
def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch, crash_at):
    model, optimizer, scheduler = build()
    save(tmp_path, 1, model, optimizer, scheduler)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, optimizer, scheduler, 1)
    with monkeypatch.context() as patch:
        fail_replace_into(patch, crash_at)
        with pytest.raises(CheckpointError, match="saving iteration 2 .*simulated crash"):
            save(tmp_path, 2, model, optimizer, scheduler)
    with open(tracker_file(str(tmp_path))) as f:
        assert f.read() == "1"

    resumed, resumed_optimizer, resumed_scheduler = build(seed=5)
    loaded = load_checkpoint(
        checkpoint_config(tmp_path), resumed, resumed_optimizer, resumed_scheduler
    )
    assert loaded.iteration == 1
    assert_state_dicts_equal(resumed.state_dict(), first)

    save(tmp_path, 2, model, optimizer, scheduler)  # a later save cleans up what was left
    assert sorted(os.listdir(tmp_path)) == [
        "iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt"
    ]  # fmt: skip


def test_half_written_temporary_directory_is_ignored(tmp_path):
    model, optimizer, scheduler = build()
    save(tmp_path, 1, model, optimizer, scheduler)
    leftover = checkpoint_file(str(tmp_path), 2).replace("iter_0000002", "iter_0000002.tmp-999")
    os.makedirs(os.path.dirname(leftover))
    with open(leftover, "wb") as f:
        f.write(b"PK\x03\x04 cut off")
    assert load_checkpoint(checkpoint_config(tmp_path), *build(seed=5)).iteration == 1
    save(tmp_path, 3, model, optimizer, scheduler)
    assert not os.path.exists(os.path.dirname(os.path.dirname(leftover)))


def test_saving_an_existing_iteration_replaces_it(tmp_path):
    model, optimizer, scheduler = build()
    save(tmp_path, 4, model, optimizer, scheduler)
    train(model, optimizer, scheduler, 1)
    save(tmp_path, 4, model, optimizer, scheduler)
    resumed, resumed_optimizer, resumed_scheduler = build(seed=5)
    load_checkpoint(checkpoint_config(tmp_path), resumed, resumed_optimizer, resumed_scheduler)
    assert_state_dicts_equal(resumed.state_dict(), model.state_dict())
    assert resumed_scheduler.num_steps == 1
    assert sorted(os.listdir(tmp_path)) == ["iter_0000004", "latest_checkpointed_iteration.txt"]
