"""pretrain_gpt.py never loads a damaged checkpoint, never overwrites checkpoints it did not
resume from, refuses a --save it could not write, and stops user errors with one line."""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal

import pytest

import pretrain_gpt
from megatron.checkpointing import CheckpointError
from tests import processes
from tests.tiny_gpt import run_expecting_error, tiny_gpt_args

TIMES = re.compile(
    r"\(min, max\) time across ranks \(ms\):\n    (save|load)-checkpoint \.+: "
    r"\(([0-9.]+), ([0-9.]+)\)"
)


def save_args(sample_prefix, directory, *extra, train_iters=10):
    return tiny_gpt_args(
        sample_prefix,
        "--save", str(directory), "--save-interval", "5", "--eval-iters", "0",
        *extra,
        train_iters=train_iters,
    )  # fmt: skip


@pytest.fixture(scope="module")
def finished_run(sample_prefix, tmp_path_factory):
    """A 10-iteration run that saved iterations 5 and 10; tests work on copies of it."""
    directory = tmp_path_factory.mktemp("finished") / "checkpoints"
    result = pretrain_gpt.main(save_args(sample_prefix, directory))
    assert result.iteration == 10
    return directory


@pytest.fixture
def checkpoints(finished_run, tmp_path):
    copy = tmp_path / "checkpoints"
    shutil.copytree(finished_run, copy)
    return copy


def test_saves_and_loads_print_megatron_timer_lines(sample_prefix, checkpoints, capsys):
    capsys.readouterr()
    pretrain_gpt.main(
        save_args(
            sample_prefix, checkpoints, "--load", str(checkpoints), "--override-opt_param-scheduler",
            train_iters=15,
        )
    )  # fmt: skip
    output = capsys.readouterr().out
    timers = TIMES.findall(output)
    assert [name for name, _, _ in timers] == ["load", "save"]
    assert all(0 < float(fastest) <= float(slowest) for _, fastest, slowest in timers)
    assert "verified the checksums of" in output


def _damage(path):
    with open(path, "r+b") as file:
        file.seek(os.path.getsize(path) // 2)
        file.write(os.urandom(64 << 10))


def test_a_damaged_checkpoint_stops_and_names_the_previous_one(sample_prefix, checkpoints, capsys):
    """A torch_dist checkpoint: the largest of its files, damaged in the middle."""
    directory = checkpoints / "iter_0000010"
    path = max(directory.glob("*.distcp"), key=os.path.getsize)
    _damage(path)
    args = save_args(sample_prefix, checkpoints, "--load", str(checkpoints), train_iters=15)
    error = run_expecting_error(args, capsys)
    assert f"checkpoint file {path} is damaged: bytes " in error
    assert error.endswith(f"echo 5 > {checkpoints}/latest_checkpointed_iteration.txt")


def test_a_damaged_torch_format_checkpoint_stops_and_names_the_previous_one(
    sample_prefix, tmp_path, capsys
):
    checkpoints = tmp_path / "checkpoints"
    pretrain_gpt.main(save_args(sample_prefix, checkpoints, "--ckpt-format", "torch"))
    path = checkpoints / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    _damage(path)
    args = save_args(sample_prefix, checkpoints, "--load", str(checkpoints), train_iters=15)
    error = run_expecting_error(args, capsys)
    assert f"checkpoint file {path} is damaged: bytes " in error
    assert error.endswith(f"echo 5 > {checkpoints}/latest_checkpointed_iteration.txt")


def test_a_lost_tracker_is_refused_naming_the_newest_checkpoint(sample_prefix, checkpoints, capsys):
    os.remove(checkpoints / "latest_checkpointed_iteration.txt")
    before = sorted(os.listdir(checkpoints))
    args = save_args(sample_prefix, checkpoints, "--load", str(checkpoints), train_iters=15)
    error = run_expecting_error(args, capsys)
    assert "holds complete checkpoints (the newest is iteration 10) but no tracker" in error
    assert f"echo 10 > {checkpoints}/latest_checkpointed_iteration.txt" in error
    assert sorted(os.listdir(checkpoints)) == before


def test_a_mistyped_load_does_not_overwrite_the_save_directory(
    sample_prefix, checkpoints, tmp_path, capsys
):
    stamps = {name: os.stat(checkpoints / name).st_mtime_ns for name in os.listdir(checkpoints)}
    args = save_args(sample_prefix, checkpoints, "--load", str(tmp_path / "checkpoint"))
    error = run_expecting_error(args, capsys)
    assert f"--save {checkpoints} holds the checkpoints of another run" in error
    assert f"pass --load {checkpoints}" in error
    assert {
        name: os.stat(checkpoints / name).st_mtime_ns for name in os.listdir(checkpoints)
    } == stamps


def test_an_empty_load_directory_keeps_megatrons_warning(sample_prefix, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    result = pretrain_gpt.main(
        save_args(sample_prefix, tmp_path / "new", "--load", str(tmp_path / "empty"), train_iters=3)
    )
    assert result.iteration == 3
    assert "WARNING: could not find the tracker file" in capsys.readouterr().out


def test_relaunching_a_finished_run_needs_no_free_space(
    sample_prefix, checkpoints, monkeypatch, capsys
):
    """It saves nothing, so a full disk must not stop it (evaluation still runs); a run that
    goes on past the checkpoint still needs room for one more."""
    usage = shutil.disk_usage(checkpoints)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1_000_000))
    args = save_args(sample_prefix, checkpoints, "--load", str(checkpoints))
    result = pretrain_gpt.main(args)
    assert result.iteration == 10 and result.losses == []
    further = save_args(
        sample_prefix, checkpoints, "--load", str(checkpoints), "--override-opt_param-scheduler",
        train_iters=15,
    )  # fmt: skip
    error = run_expecting_error(further, capsys)
    assert "its file system has 0.00 GB free" in error, error


def test_relaunching_a_finished_run_writes_nothing(sample_prefix, checkpoints, capsys):
    def stamps():
        return {
            os.path.join(parent, name): os.stat(os.path.join(parent, name)).st_mtime_ns
            for parent, _, names in os.walk(checkpoints)
            for name in names
        }

    before = stamps()
    capsys.readouterr()
    result = pretrain_gpt.main(save_args(sample_prefix, checkpoints, "--load", str(checkpoints)))
    assert result.iteration == 10 and result.losses == []
    assert "saved checkpoint" not in capsys.readouterr().out
    assert stamps() == before


def test_save_directory_problems_stop_before_training(sample_prefix, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    error = run_expecting_error(save_args(sample_prefix, a_file), capsys)
    assert error == f"error: --save {a_file} is a file, not a directory; give a directory"
    error = run_expecting_error(save_args(sample_prefix, a_file / "below"), capsys)
    assert error.startswith(f"error: --save {a_file}/below cannot be written: ")


def test_too_little_free_space_is_refused_with_the_size_needed(
    sample_prefix, tmp_path, monkeypatch, capsys
):
    usage = shutil.disk_usage(tmp_path)
    # The file system reports 1 MB free: less than the tiny model's weights and Adam moments.
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1_000_000))
    error = run_expecting_error(save_args(sample_prefix, tmp_path / "checkpoints"), capsys)
    needed = re.search(r"needs about ([0-9.]+) GB", error)
    assert "its file system has 0.00 GB free" in error and needed, error
    # 2 layers of hidden 64 with a 50304-token vocabulary: 3.33 M fp32 weights and 2 moments.
    assert 0.039 < float(needed.group(1)) < 0.041


def _limit_file_size() -> None:
    # A file larger than this fails with EFBIG ("File too large") instead of killing the
    # process: a real write error from the kernel, as a full disk gives ENOSPC.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 20, 8 << 20))


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch"])
def test_a_failed_save_says_why_and_keeps_the_previous_checkpoint(
    sample_prefix, checkpoints, tmp_path, ckpt_format
):
    """A tiny model's checkpoint (40 MB) does not fit a file-size limit of 8 MB."""
    shutil.rmtree(checkpoints / "iter_0000010")
    (checkpoints / "latest_checkpointed_iteration.txt").write_text("5")
    args = save_args(
        sample_prefix, checkpoints, "--load", str(checkpoints), "--ckpt-format", ckpt_format
    )
    completed = processes.run(args, before=_limit_file_size)
    assert completed.returncode == 1, completed.stderr[-3000:]
    error = completed.stderr.strip()
    assert error.startswith("error: saving iteration 10 under ") and "\n" not in error, error
    if ckpt_format == "torch":
        assert "File too large (EFBIG) writing " in error
    else:  # torch.save inside DCP reports the short write, not the errno
        assert "unexpected pos" in error
    assert "the latest checkpoint is still iteration 5" in error
    assert sorted(os.listdir(checkpoints)) == ["iter_0000005", "latest_checkpointed_iteration.txt"]


def test_more_data_parallel_ranks_than_saved_rng_states_are_refused_by_every_rank(
    sample_prefix, checkpoints
):
    """The one-process checkpoint holds one RNG state: resumed on two data-parallel ranks
    without --no-load-rng, rank 1 has none. Every rank refuses before any reports the load
    (rank 0 had printed `loaded checkpoint ...` and then died in a barrier with gloo's
    traceback, while rank 1 stopped)."""
    args = save_args(
        sample_prefix, checkpoints, "--load", str(checkpoints),
        "--use-checkpoint-opt_param-scheduler", train_iters=12,
    )  # fmt: skip
    completed = processes.run(args, nproc=2, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert completed.returncode == 1, completed.stderr[-3000:]
    assert "loaded checkpoint" not in completed.stdout
    assert "Traceback" not in completed.stderr, completed.stderr[-3000:]
    errors = [line for line in completed.stderr.splitlines() if line.startswith("error: ")]
    assert errors and all(line == errors[0] for line in errors), completed.stderr[-3000:]
    assert errors[0] == (
        f"error: {checkpoints / 'iter_0000010'} holds RNG states for 1 data-parallel ranks, "
        "none for rank 1; resuming on more data-parallel ranks than were saved needs "
        "--no-load-rng"
    )


def test_a_checkpoint_of_another_shape_names_the_flags(sample_prefix, checkpoints, capsys):
    args = save_args(sample_prefix, checkpoints, "--load", str(checkpoints), train_iters=15)
    args[args.index("--hidden-size") + 1] = "32"
    error = run_expecting_error(args, capsys)
    assert error == (
        f"error: the model in {checkpoints}/iter_0000010 does not "
        "fit this run's: --hidden-size 64 in the checkpoint, 32 now; --ffn-hidden-size 256 in the "
        "checkpoint, 128 now; run with the checkpoint's values of these flags"
    )


def test_the_traceback_is_shown_when_asked(sample_prefix, checkpoints, monkeypatch):
    monkeypatch.setenv("MEGATRON_TRACEBACK", "1")
    args = save_args(sample_prefix, checkpoints, "--load", str(checkpoints), train_iters=15)
    args[args.index("--hidden-size") + 1] = "32"
    with pytest.raises(CheckpointError, match="--hidden-size 64 in the checkpoint, 32 now"):
        pretrain_gpt.main(args)


def test_a_changed_model_flag_that_fits_is_a_warning(sample_prefix, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MEGATRON_KERNELS", "reference")
    moe = ("--seq-length", "32", "--max-position-embeddings", "32", "--moe-num-experts", "4")
    directory = tmp_path / "checkpoints"
    pretrain_gpt.main(save_args(sample_prefix, directory, *moe, "--moe-top-k", "2", train_iters=3))
    capsys.readouterr()
    resumed = pretrain_gpt.main(
        save_args(
            sample_prefix, directory, *moe, "--moe-top-k", "1", "--load", str(directory),
            train_iters=3,
        )
    )  # fmt: skip
    assert resumed.iteration == 3
    assert re.search(
        r"WARNING: .*iter_0000003 was saved with other model "
        r"flags than this run's \(its weights fit, but the model computes differently\): "
        r"--moe-top-k 2 in the checkpoint, 1 now\n",
        capsys.readouterr().out,
    )


def test_experts_of_another_size_are_refused_naming_the_flag(
    sample_prefix, tmp_path, capsys, monkeypatch
):
    """--moe-ffn-hidden-size is a model flag: experts of another size do not fit, and the
    error names it. The layers the checkpoint's integer --moe-layer-freq made MoE layers,
    given as a pattern, load without a warning."""
    monkeypatch.setenv("MEGATRON_KERNELS", "reference")
    moe = ("--seq-length", "32", "--max-position-embeddings", "32", "--moe-num-experts", "4")
    directory = tmp_path / "checkpoints"
    experts = ("--moe-ffn-hidden-size", "32", "--moe-layer-freq", "1")
    pretrain_gpt.main(save_args(sample_prefix, directory, *moe, *experts, train_iters=3))
    capsys.readouterr()
    same_layers = ("--moe-ffn-hidden-size", "32", "--moe-layer-freq", "[1,1]")
    resumed = pretrain_gpt.main(
        save_args(
            sample_prefix, directory, *moe, *same_layers, "--load", str(directory), train_iters=3
        )
    )  # fmt: skip
    assert resumed.iteration == 3
    assert "saved with other model flags" not in capsys.readouterr().out
    other_size = ("--moe-ffn-hidden-size", "64")
    args = save_args(sample_prefix, directory, *moe, *other_size, "--load", str(directory))
    assert run_expecting_error(args, capsys) == (
        f"error: the model in {directory}/iter_0000003 does not fit this run's: "
        "--moe-ffn-hidden-size 32 in the checkpoint, 64 now; run with the checkpoint's values "
        "of these flags"
    )


def test_extending_a_run_needs_a_schedule_rule(sample_prefix, checkpoints, capsys):
    longer = save_args(sample_prefix, checkpoints, "--load", str(checkpoints), train_iters=20)
    error = run_expecting_error(longer, capsys)
    assert "the learning-rate schedule differs from the checkpoint's: decay_steps 80 in the " in (
        error
    )
    assert "160 now" in error
    assert "--override-opt_param-scheduler" in error
    assert "--use-checkpoint-opt_param-scheduler" in error

    extended = pretrain_gpt.main([*longer, "--override-opt_param-scheduler"])
    assert extended.iteration == 20 and len(extended.losses) == 10


def test_the_checkpoints_schedule_can_be_kept(sample_prefix, checkpoints, capsys):
    longer = save_args(sample_prefix, checkpoints, "--load", str(checkpoints), train_iters=12)
    capsys.readouterr()
    pretrain_gpt.main([*longer, "--use-checkpoint-opt-param-scheduler"])
    rates = re.findall(r"learning rate: ([0-9.E+-]+) \|", capsys.readouterr().out)
    # The saved schedule decayed to --min-lr at iteration 10; it stays there.
    assert [float(rate) for rate in rates] == [3.0e-4, 3.0e-4]


def test_both_schedule_rules_are_refused(sample_prefix, tmp_path, capsys):
    args = save_args(
        sample_prefix, tmp_path, "--override-opt_param-scheduler",
        "--use-checkpoint-opt_param-scheduler",
    )  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.main(args)
    assert exit_info.value.code == 2
    assert "contradict each other" in capsys.readouterr().err
