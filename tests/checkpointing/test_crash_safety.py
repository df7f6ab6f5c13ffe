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


def test_saving_the_tracked_iteration_again_leaves_it_untouched(tmp_path, capsys):
    model, optimizer, scheduler = build()
    save(tmp_path, 4, model, optimizer, scheduler)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    path = checkpoint_file(str(tmp_path), 4)
    before = os.stat(path)
    train(model, optimizer, scheduler, 1)
    save(tmp_path, 4, model, optimizer, scheduler)
    assert "iteration 4 is already saved" in capsys.readouterr().out
    after = os.stat(path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    resumed, resumed_optimizer, resumed_scheduler = build(seed=5)
    load_checkpoint(checkpoint_config(tmp_path), resumed, resumed_optimizer, resumed_scheduler)
    assert_state_dicts_equal(resumed.state_dict(), saved)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000004", "latest_checkpointed_iteration.txt"]


def _count_replaces(monkeypatch) -> list:
    calls = []
    real_replace = os.replace

    def replace(source, destination):
        calls.append(destination)
        real_replace(source, destination)

    monkeypatch.setattr(os, "replace", replace)
    return calls


def _fail_rename_number(monkeypatch, failing: int) -> None:
    """Make the `failing`-th os.replace from now (0-based) raise once, as a crash there would."""
    calls = {"count": 0}
    real_replace = os.replace

    def replace(source, destination):
        calls["count"] += 1
        if calls["count"] == failing + 1:
            raise OSError(f"simulated crash before {destination} was written")
        real_replace(source, destination)

    monkeypatch.setattr(os, "replace", replace)


def test_replacing_a_newer_iteration_never_leaves_the_tracker_dangling(tmp_path, monkeypatch):
    """A run rewound to iteration 2 (the tracker edited back) saves 4 again over the old 4:
    cut at every rename of that save, the tracker names a complete checkpoint that loads."""
    model, optimizer, scheduler = build()
    save(tmp_path, 2, model, optimizer, scheduler)
    train(model, optimizer, scheduler, 1)
    save(tmp_path, 4, model, optimizer, scheduler)
    with open(tracker_file(str(tmp_path)), "w") as f:
        f.write("2")
    train(model, optimizer, scheduler, 1)
    with monkeypatch.context() as patch:
        renames = _count_replaces(patch)
        save(tmp_path, 2 + 2, model, optimizer, scheduler)
    assert len(renames) >= 3  # old 4 aside, new 4 in, tracker
    rewound_state = {k: v.clone() for k, v in model.state_dict().items()}
    for cut in range(len(renames)):
        # Restore the rewound layout, then cut the save at rename number `cut`.
        with open(tracker_file(str(tmp_path)), "w") as f:
            f.write("2")
        with monkeypatch.context() as patch:
            _fail_rename_number(patch, cut)
            with pytest.raises(CheckpointError):
                save(tmp_path, 4, model, optimizer, scheduler)
        resumed = build(seed=5)
        loaded = load_checkpoint(checkpoint_config(tmp_path), *resumed)
        assert loaded.iteration in (2, 4)
        # A failed save puts back the directory it was replacing.
        assert os.path.isfile(checkpoint_file(str(tmp_path), 4)), f"cut at rename {cut}"
    save(tmp_path, 4, model, optimizer, scheduler)
    resumed, resumed_optimizer, resumed_scheduler = build(seed=5)
    assert load_checkpoint(checkpoint_config(tmp_path), resumed).iteration == 4
    assert_state_dicts_equal(resumed.state_dict(), rewound_state)
