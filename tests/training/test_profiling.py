"""Megatron's --profile flags: which iterations are recorded, where the trace goes, bad flags."""

import json

import pytest
import torch

import pretrain_gpt
from megatron.config import LoggingConfig
from megatron.training.profiling import StepProfiler
from tests.tiny_gpt import tiny_gpt_args


def _trace_events(directory):
    traces = sorted(directory.glob("rank0.*.pt.trace.json"))
    assert len(traces) == 1, list(directory.iterdir())
    return json.loads(traces[0].read_text())["traceEvents"]


def test_pytorch_profiler_records_exactly_the_asked_iterations(data_prefix, tmp_path, capsys):
    board = tmp_path / "tb"
    flags = ["--profile", "--use-pytorch-profiler", "--tensorboard-dir", str(board)]
    flags += ["--profile-step-start", "1", "--profile-step-end", "3"]
    result = pretrain_gpt.main(tiny_gpt_args(data_prefix, *flags, train_iters=5))
    assert len(result.losses) == 5

    events = _trace_events(board)
    spans = sorted({event["name"] for event in events if event["name"].startswith("iteration ")})
    assert spans == ["iteration 2", "iteration 3"]
    names = {event["name"] for event in events}
    assert "aten::mm" in names or "aten::addmm" in names, sorted(names)[:50]

    table = (board / "profile_rank0_iterations2-3.txt").read_text()
    assert "Self CPU" in table and "aten::" in table
    assert "profiled iterations 2-3" in capsys.readouterr().out


def test_a_run_that_ends_early_still_writes_its_trace(data_prefix, tmp_path):
    board = tmp_path / "tb"
    flags = ["--profile", "--use-pytorch-profiler", "--tensorboard-dir", str(board)]
    flags += ["--profile-step-start", "2", "--profile-step-end", "10"]
    pretrain_gpt.main(tiny_gpt_args(data_prefix, *flags, train_iters=3))
    spans = {event["name"] for event in _trace_events(board) if event["name"].startswith("iter")}
    assert spans == {"iteration 3"}
    assert (board / "profile_rank0_iterations3-10.txt").is_file()


def test_only_listed_ranks_record(tmp_path):
    config = LoggingConfig(
        tensorboard_dir=str(tmp_path), profile=True, use_pytorch_profiler=True,
        profile_step_start=0, profile_step_end=1, profile_ranks=(1, 3),
    )  # fmt: skip
    for rank, records in ((0, False), (1, True), (2, False), (3, True)):
        profiler = StepProfiler(config, rank, torch.device("cpu"))
        profiler.before_step(0)
        torch.ones(4).sum()
        profiler.after_step(1)
        assert profiler.enabled == records
        assert (tmp_path / f"profile_rank{rank}_iterations1-1.txt").is_file() == records
    assert len(list(tmp_path.glob("rank*.pt.trace.json"))) == 2


def test_without_profile_no_trace_is_written(data_prefix, tmp_path):
    board = tmp_path / "tb"
    pretrain_gpt.main(tiny_gpt_args(data_prefix, "--tensorboard-dir", str(board), train_iters=3))
    assert board.is_dir() and not list(board.glob("*.pt.trace.json"))


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--use-pytorch-profiler"], "--use-pytorch-profiler only takes effect with --profile"),
        (["--profile", "--use-pytorch-profiler"], "set --tensorboard-dir"),
        (
            ["--profile", "--use-pytorch-profiler", "--tensorboard-dir", "tb"]
            + ["--profile-step-start", "3", "--profile-step-end", "3"],
            "--profile-step-start 3 and --profile-step-end 3",
        ),
        (
            ["--profile", "--use-pytorch-profiler", "--tensorboard-dir", "tb"]
            + ["--profile-ranks", "0", "2"],
            "--profile-ranks 2: no such rank in a world of 1",
        ),
    ],
)
def test_bad_profile_flags_are_rejected_before_work(data_prefix, capsys, extra, message):
    with pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.main(tiny_gpt_args(data_prefix, *extra))
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_nsys_profiling_needs_a_gpu(data_prefix, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit):
        pretrain_gpt.main(tiny_gpt_args(data_prefix, "--profile"))
    assert "add --use-pytorch-profiler" in capsys.readouterr().err
