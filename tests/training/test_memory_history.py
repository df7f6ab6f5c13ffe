"""Megatron-Core's --record-memory-history and --memory-snapshot-path: parsing, the refusals
(each asserting its line), and on a GPU the snapshot a tiny run writes."""

import pickle

import pytest
import torch

import pretrain_gpt
from megatron.config import ConfigError, LoggingConfig, parse_config
from megatron.initialize import DistributedContext
from megatron.training.memory_history import dump_memory_snapshot
from tests.config.command_lines import argv
from tests.markers import gpu
from tests.tiny_gpt import tiny_gpt_args


@pytest.fixture
def visible_gpu(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)


def test_snapshot_path_defaults_to_megatron_cores(visible_gpu):
    logging = parse_config(argv("--record-memory-history")).logging
    assert logging.record_memory_history
    assert logging.memory_snapshot_path == "snapshot.pickle"


def test_snapshot_path_is_taken(visible_gpu):
    flags = ["--record-memory-history", "--memory-snapshot-path", "runs/a/memory.pickle"]
    assert parse_config(argv(*flags)).logging.memory_snapshot_path == "runs/a/memory.pickle"


def test_off_by_default():
    logging = parse_config(argv()).logging
    assert not logging.record_memory_history and logging.memory_snapshot_path is None


def test_recording_without_a_gpu_is_refused(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ConfigError) as raised:
        parse_config(argv("--record-memory-history"))
    assert str(raised.value) == (
        "--record-memory-history records the CUDA caching allocator and needs a GPU; none is "
        "visible: drop --record-memory-history"
    )


def test_a_snapshot_path_without_recording_is_refused(data_prefix, capsys):
    with pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.main(tiny_gpt_args(data_prefix, "--memory-snapshot-path", "m.pickle"))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "error: --memory-snapshot-path m.pickle only takes effect with --record-memory-history; "
        "add --record-memory-history\n"
    )


def test_only_the_last_rank_writes(tmp_path):
    path = tmp_path / "snapshot.pickle"
    config = LoggingConfig(record_memory_history=True, memory_snapshot_path=str(path))
    context = DistributedContext(0, 2, 0, torch.device("cpu"), None)
    dump_memory_snapshot(config, context)  # rank 0 of 2: returns before asking CUDA
    assert not path.exists()


@gpu
def test_a_run_writes_a_snapshot_that_loads(data_prefix, tmp_path):
    path = tmp_path / "snapshots" / "memory.pickle"
    flags = ["--record-memory-history", "--memory-snapshot-path", str(path)]
    try:
        pretrain_gpt.main(tiny_gpt_args(data_prefix, *flags, train_iters=3))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)  # later tests run unrecorded
    with open(path, "rb") as handle:
        snapshot = pickle.load(handle)
    assert snapshot["segments"], "the snapshot holds no memory of the run"
    assert any(trace for trace in snapshot["device_traces"]), "no allocation history"
