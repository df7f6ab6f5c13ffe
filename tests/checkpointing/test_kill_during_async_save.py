"""A few SIGKILLs during asynchronous saves (the script runs 20 on request): every relaunch
loads the complete checkpoint the tracker names; in one process, and in two under FSDP2, whose
ranks each write their shards."""

from __future__ import annotations

from tests.checkpointing import kill_during_async_save


def test_kills_during_async_saves_leave_a_loadable_checkpoint(data_prefix, tmp_path, capsys):
    assert (
        kill_during_async_save.run(data_prefix, str(tmp_path), kills=3, seed=1, window_s=2.0) == 0
    )
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("3 kills, ") and summary.endswith("resumed and finished; 0 failures")


def test_kills_during_fully_sharded_async_saves_leave_a_loadable_checkpoint(
    data_prefix, tmp_path, capsys
):
    code = kill_during_async_save.run(
        data_prefix, str(tmp_path), kills=2, seed=2, window_s=5.0, nproc=2,
        extra=("--use-torch-fsdp2",),
    )  # fmt: skip
    assert code == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("2 kills, ") and summary.endswith("resumed and finished; 0 failures")
