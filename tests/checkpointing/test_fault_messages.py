"""What a user reads when a checkpoint is not there to load or a save is interrupted: the
format's own missing file, an interrupt named as one (not as a disk failure), and what is left
on disk."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import pretrain_gpt
from megatron.checkpointing import checksums, sharded_save
from tests.tiny_gpt import run_expecting_error, tiny_gpt_args


def _train(data_prefix: str, save: Path, *extra: str, iters: int = 4):
    return tiny_gpt_args(
        data_prefix, "--save", str(save), "--save-interval", "2", "--eval-iters", "0", *extra,
        train_iters=iters,
    )  # fmt: skip


@pytest.fixture(scope="module")
def torch_dist_run(data_prefix, tmp_path_factory) -> Path:
    """A torch_dist run saved at iterations 2 and 4."""
    save = tmp_path_factory.mktemp("saved") / "ckpt"
    pretrain_gpt.main(_train(data_prefix, save))
    return save


def test_a_torch_dist_checkpoint_without_its_marker_is_named_as_one(
    data_prefix, torch_dist_run, tmp_path, capsys
):
    save = tmp_path / "ckpt"
    shutil.copytree(torch_dist_run, save)
    (save / "iter_0000004" / "metadata.json").unlink()
    error = run_expecting_error(_train(data_prefix, save, "--load", str(save), iters=6), capsys)
    assert f"{save / 'iter_0000004'} is a torch_dist checkpoint (it holds " in error
    assert "whose metadata.json is missing" in error and "model_optim_rng.pt" not in error
    assert "echo 2 > " in error


def test_a_missing_iteration_directory_is_named(data_prefix, torch_dist_run, tmp_path, capsys):
    save = tmp_path / "ckpt"
    shutil.copytree(torch_dist_run, save)
    shutil.rmtree(save / "iter_0000004")
    error = run_expecting_error(_train(data_prefix, save, "--load", str(save), iters=6), capsys)
    assert error.startswith(
        f"error: the tracker names iteration 4, but its directory {save / 'iter_0000004'} "
        "does not exist;"
    )
    assert "model_optim_rng.pt" not in error


def _interrupt_second_save(monkeypatch, ckpt_format: str) -> None:
    """Ctrl-C while the second checkpoint (iteration 4) is being written."""
    saves = []
    if ckpt_format == "torch_dist":
        write = sharded_save.write_sharded_files

        def interrupted(directory, *args, **kwargs):
            written = write(directory, *args, **kwargs)  # the files are there, half a save
            saves.append(directory)
            if len(saves) == 2:
                raise KeyboardInterrupt
            return written

        monkeypatch.setattr(sharded_save, "write_sharded_files", interrupted)
    else:
        # torch.save calls the writer from C++, which turns what it raises into a RuntimeError
        # of its own: the interrupt, arriving inside the writer, must still be told apart.
        original = checksums.ChecksumWriter._queue_blocks

        def interrupted(self, view):
            if not getattr(self, "counted", False):  # one writer per checkpoint file
                self.counted = True
                saves.append(self)
            if len(saves) == 2 and self.size > 100_000:
                raise KeyboardInterrupt
            return original(self, view)

        monkeypatch.setattr(checksums.ChecksumWriter, "_queue_blocks", interrupted)


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch"])
def test_ctrl_c_during_a_save_is_reported_as_an_interrupt(
    data_prefix, tmp_path, capsys, monkeypatch, ckpt_format
):
    save = tmp_path / "ckpt"
    _interrupt_second_save(monkeypatch, ckpt_format)
    error = run_expecting_error(_train(data_prefix, save, "--ckpt-format", ckpt_format), capsys)
    assert error == (
        f"error: saving iteration 4 under {save} was interrupted (Ctrl-C); its partial files "
        f"were removed and the latest checkpoint is still iteration 2; resume with --load {save}"
    )
    assert sorted(p.name for p in save.iterdir()) == [
        "iter_0000002",
        "latest_checkpointed_iteration.txt",
    ]
