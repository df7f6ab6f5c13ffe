"""--wandb-project: what a tiny dMoE run logs to Weights & Biases (offline), read back from W&B's
own record file and checked against Megatron's log lines and TensorBoard; a resumed run
continues the same W&B run; without the wandb package the flag is refused before any work."""

import json
import os
import re
import struct
import sys
import zlib
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest

import pretrain_gpt
from megatron.training.wandb_logger import RUN_ID_FILE
from tests import processes
from tests.tiny_gpt import MOE_ARGS, tensorboard_scalars, tiny_gpt_args

ITERATION_LINE = re.compile(
    r" iteration +(\d+)/ +\d+ \|.* learning rate: ([0-9.E+-]+) \|.* lm loss: ([0-9.E+-]+) \|"
)
VALIDATION_LINE = re.compile(r" validation loss at (.+?) \| lm loss value: ([0-9.E+-]+)")

# The .wandb file: W&B's 7-byte header, then LevelDB's log format (32 KiB blocks of records,
# each a checksum, length and type; a record too long for its block continues in the next).
WANDB_FILE_HEADER = struct.Struct("<4sHB")
RECORD_HEADER = struct.Struct("<IHB")
BLOCK_BYTES = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf Records of a run's `run-<id>.wandb` file, in order (W&B's Python reader of
    this file left the package when its Go core took over writing it)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert WANDB_FILE_HEADER.unpack_from(data) == (b":W&B", 0xBEE1, 0), data[:7]
    offset, pending = WANDB_FILE_HEADER.size, b""
    while offset + RECORD_HEADER.size <= len(data):
        if BLOCK_BYTES - offset % BLOCK_BYTES < RECORD_HEADER.size:  # the block's zero trailer
            offset += BLOCK_BYTES - offset % BLOCK_BYTES
            continue
        checksum, length, kind = RECORD_HEADER.unpack_from(data, offset)
        if kind == 0:  # zeros the writer had not yet filled
            break
        payload = data[offset + RECORD_HEADER.size : offset + RECORD_HEADER.size + length]
        assert zlib.crc32(payload, zlib.crc32(bytes([kind]))) == checksum, f"{path} at {offset}"
        offset += RECORD_HEADER.size + length
        pending += payload
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _offline_run(parent: Path) -> Dict[str, Any]:
    """The one offline W&B run under `parent` (W&B's dir: its files are in parent/wandb/):
    {"id": run id, "history": {step: {name: value}}}."""
    runs = sorted((parent / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    (record_file,) = runs[0].glob("run-*.wandb")
    history: Dict[int, Dict[str, Any]] = {}
    for record in _wandb_records(record_file):
        if record.WhichOneof("record_type") == "history":
            row = history.setdefault(record.history.step.num, {})
            for item in record.history.item:
                row[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return {"id": record_file.stem[len("run-") :], "history": history}


@pytest.fixture(scope="module")
def resumed_run(data_prefix, tmp_path_factory) -> Dict[str, Any]:
    """6 iterations in two runs of their own processes, as a user would start them: the first,
    also writing TensorBoard, stops at iteration 3 (--exit-interval) with W&B's files in
    --wandb-save-dir; the second resumes from --save, its W&B files in the default
    <--save>/wandb. Validation at iterations 3 and 6 and at the end."""
    root = tmp_path_factory.mktemp("wandb_run")
    save = root / "checkpoints"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    # W&B's settings and caches, which otherwise go to the home directory.
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        env[name] = str(root / name)
    common = ["--wandb-project", "tiny", "--wandb-exp-name", "resumed", "--save", str(save)]
    common += ["--save-interval", "3", "--eval-interval", "3"]

    def run(*flags: str) -> processes.Finished:
        args = tiny_gpt_args(data_prefix, *MOE_ARGS, *common, *flags, train_iters=6)
        finished = processes.run(args, env=env)
        assert finished.returncode == 0, finished.stderr[-3000:]
        return finished

    first = run("--exit-interval", "3", "--wandb-save-dir", str(root / "first"),
                "--tensorboard-dir", str(root / "tb"))  # fmt: skip
    run_id_after_first = (save / RUN_ID_FILE).read_text().strip()
    second = run("--load", str(save))
    return {
        "first": {"stdout": first.stdout, **_offline_run(root / "first")},
        "second": {"stdout": second.stdout, **_offline_run(save / "wandb")},
        "run_id_file": run_id_after_first,
        "tensorboard": root / "tb",
    }


@pytest.mark.parametrize("part, iterations", [("first", [1, 2, 3]), ("second", [4, 5, 6])])
def test_loss_and_learning_rate_are_the_log_lines(resumed_run, part, iterations):
    run = resumed_run[part]
    lines = ITERATION_LINE.findall(run["stdout"])
    assert [int(iteration) for iteration, _, _ in lines] == iterations
    for iteration, learning_rate, loss in lines:
        logged = run["history"][int(iteration)]
        assert f"{logged['learning-rate']:.3E}" == learning_rate, iteration
        assert f"{logged['lm loss']:.6E}" == loss, iteration


# W&B keeps one value of a name per step, the last logged: at the last iteration, that of the
# validation split's evaluation after training (TensorBoard keeps both); the test split's, after
# it, has names of its own.
@pytest.mark.parametrize(
    "part, iteration, where",
    [("first", 3, "iteration 3"), ("second", 6, "the end of training for val data")],
)
def test_validation_loss_and_perplexity_are_logged(resumed_run, part, iteration, where):
    run = resumed_run[part]
    printed = dict(VALIDATION_LINE.findall(run["stdout"]))[where]
    logged = run["history"][iteration]
    assert f"{logged['lm loss validation']:.6E}" == printed
    assert logged["lm loss validation ppl"] > 1.0


def test_the_test_loss_is_logged_apart_from_the_validation_loss(resumed_run):
    run = resumed_run["second"]
    printed = dict(VALIDATION_LINE.findall(run["stdout"]))["the end of training for test data"]
    logged = run["history"][6]
    assert f"{logged['lm loss test']:.6E}" == printed
    assert logged["lm loss test ppl"] > 1.0
    # Nowhere else: the first part stopped before training's end (--exit-interval).
    earlier = [row for part in ("first", "second") for step, row in
               resumed_run[part]["history"].items() if step != 6]  # fmt: skip
    assert earlier and not any(name.startswith("lm loss test") for row in earlier for name in row)


def test_wandb_gets_every_tensorboard_scalar(resumed_run):
    """The first part wrote TensorBoard too: each scalar it got against iterations, the dMoE's
    per-expert ones included, W&B got at the same step, equal up to TensorBoard's float32."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(resumed_run["tensorboard"]))
    events.Reload()
    names = [name for name in events.Tags()["scalars"] if not name.endswith(" vs samples")]
    assert {"learning-rate", "grad-norm", "batch-size", "loss-scale", "lm loss"} <= set(names)
    # The dMoE's: its auxiliary loss and each layer's expert load, per expert too.
    expert_load = {f"moe/tokens-per-expert over-mean layer {layer} expert {expert}"
                   for layer in (0, 1) for expert in range(4)}  # fmt: skip
    assert {"load balancing loss", *expert_load} <= set(names), names
    history = resumed_run["first"]["history"]
    for name, steps in tensorboard_scalars(resumed_run["tensorboard"], names).items():
        for step, value in steps.items():
            assert struct.unpack("f", struct.pack("f", history[step][name]))[0] == value, name
    assert [history[step]["samples vs steps"] for step in (1, 2, 3)] == [8, 16, 24]
    # Each MoE layer's histogram of tokens per expert: one count per expert.
    for step, layer in ((1, 0), (3, 1)):
        histogram = f"moe/tokens-per-expert layer {layer}"
        assert history[step][f"{histogram}/_type"] == "histogram"
        assert sum(history[step][f"{histogram}/values"]) == 4


def test_a_resumed_run_continues_its_wandb_run(resumed_run):
    first, second = resumed_run["first"], resumed_run["second"]
    assert first["id"] == second["id"] == resumed_run["run_id_file"]


def test_without_wandb_the_flag_is_refused_in_one_line(data_prefix, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: imports fail
    with pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.main(tiny_gpt_args(data_prefix, "--wandb-project", "tiny"))
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and error.startswith("error: --wandb-project tiny"), error
    assert "pip install -e '.[wandb]'" in error
