"""pretrain_gpt.py end to end on the sample corpus: learning, data parallel, exact resume, fp16, errors."""

import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import pretrain_gpt
from megatron.checkpointing import torch_dist
from tests import processes
from tests.sample_data import REPO
from tests.tiny_gpt import saved_state, tiny_gpt_args

LOSS_PATTERN = re.compile(r" iteration +(\d+)/ +\d+ \|.* lm loss: ([0-9.E+-]+) \|")


def _losses(result):
    return [losses["lm loss"] for losses in result.losses]


def test_loss_falls_on_the_sample_corpus(data_prefix):
    result = pretrain_gpt.main(tiny_gpt_args(data_prefix, train_iters=30))
    losses = _losses(result)
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0, losses
    final_validation = dict(result.validation)["the end of training for val data"]["lm loss"]
    assert final_validation < losses[0] - 1.0


def _final_parameters(save_dir):
    latest = (Path(save_dir) / "latest_checkpointed_iteration.txt").read_text().strip()
    return int(latest), saved_state(save_dir)


# 12 iterations of 32-token sequences: what resuming must reproduce does not depend on the shape.
SHORT_RUN = {"train_iters": 12, "seq_length": 32}


def test_resume_is_bit_exact(data_prefix, tmp_path):
    """12 iterations straight == 6, save, a new process-like start with --load, 6 more; with
    dropout, and an evaluation in each half (iterations 4, 8 and 12)."""
    straight_dir, split_dir = tmp_path / "straight", tmp_path / "split"
    common = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--eval-interval", "4",
              "--eval-iters", "1", "--save-interval", "6"]  # fmt: skip
    straight = pretrain_gpt.main(
        tiny_gpt_args(data_prefix, *common, "--save", str(straight_dir), **SHORT_RUN)
    )
    split = [*common, "--save", str(split_dir)]
    first = pretrain_gpt.main(
        tiny_gpt_args(data_prefix, *split, "--exit-interval", "6", **SHORT_RUN)
    )
    assert first.exit_reason == "interval" and first.iteration == 6
    torch.manual_seed(999)  # the resumed run must not depend on the state the process was left in
    second = pretrain_gpt.main(
        tiny_gpt_args(data_prefix, *split, "--load", str(split_dir), **SHORT_RUN)
    )
    assert _losses(first) + _losses(second) == _losses(straight)
    assert straight.validation[-2:] == second.validation[-2:]
    straight_iteration, straight_state = _final_parameters(straight_dir)
    split_iteration, split_state = _final_parameters(split_dir)
    assert straight_iteration == split_iteration == 12
    assert straight_state["model"].keys() == split_state["model"].keys()
    for name, tensor in straight_state["model"].items():
        assert torch.equal(tensor, split_state["model"][name]), name


def test_fp16_overflow_is_skipped_and_counted(data_prefix, tmp_path):
    # Megatron's first fp16 steps overflow at a huge initial scale and are skipped while it halves.
    # Run as a user would, in its own process: CPU half-precision matmuls inside pytest's process
    # took a slow fallback path (about 50x slower) on the machine this was written on.
    args = tiny_gpt_args(
        data_prefix,
        "--fp16", "--initial-loss-scale", str(2**24), "--hysteresis", "1",
        "--seq-length", "16", "--eval-iters", "0",
        train_iters=16, micro_batch=1, global_batch=1,
    )  # fmt: skip
    completed = processes.run(args)
    assert completed.returncode == 0, completed.stderr[-3000:]
    output = completed.stdout
    skipped_counts = [
        int(count) for count in re.findall(r"number of skipped iterations: +(\d+)", output)
    ]
    assert len(skipped_counts) == 16 and 0 < sum(skipped_counts) < 16, skipped_counts
    # Overflowing gradients with a finite loss are skips, not NaN iterations, and do not stop
    # the run (--check-for-nan-in-loss-and-grad is on).
    assert set(re.findall(r"number of nan iterations: +(\d+)", output)) == {"0"}
    scales = [float(scale) for scale in re.findall(r"loss scale: ([0-9.]+)", output)]
    assert scales[0] == 2.0**23, scales  # halved once by the first overflow (hysteresis 1)
    assert all(later <= earlier for earlier, later in zip(scales, scales[1:]))
    # Once the scale fits, steps succeed and report finite losses; skipped ones report none.
    losses = [float(loss) for _, loss in LOSS_PATTERN.findall(output)]
    assert len(losses) == 16 - sum(skipped_counts)
    assert all(loss == loss and loss < 20 for loss in losses)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--num-attention-heads", "5"], "--num-attention-heads"),
        (["--global-batch-size", "6"], "--global-batch-size"),
        (["--bf16", "--fp16"], "--fp16"),
        (["--fp8-format", "e4m3"], "add --bf16"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_bad_flags_are_rejected_before_work(data_prefix, capsys, extra, message):
    with pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.main(tiny_gpt_args(data_prefix, *extra))
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and message in error


def test_fp8_on_a_device_without_fp8_stops_at_start_up(data_prefix, capsys):
    """--fp8-format on the CPU: one line saying why, exit 1, before any iteration."""
    with pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.main(tiny_gpt_args(data_prefix, "--bf16", "--fp8-format", "e4m3"))
    assert exit_info.value.code == 1
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: --fp8-format e4m3: FP8 products need a GPU with FP8 tensor cores (NVIDIA "
        "compute capability 8.9 or newer, AMD MI300); this run is on the CPU; train without "
        "--fp8-format"
    ]
    assert " iteration " not in captured.out


class SimulatedKill(BaseException):
    """A process dying mid-save, as SIGKILL would, but inside pytest: nothing in the project
    handles it (a Ctrl-C is handled: tests/checkpointing/test_fault_messages.py)."""


def test_checkpoint_cut_mid_save_is_ignored(data_prefix, tmp_path, monkeypatch):
    save_dir = tmp_path / "ckpt"
    args = tiny_gpt_args(
        data_prefix, "--save", str(save_dir), "--save-interval", "5", "--ckpt-format", "torch",
        train_iters=10,
    )  # fmt: skip
    original_save = torch.save
    calls = {"count": 0}

    def save_that_dies_on_the_second_checkpoint(obj, f, *a, **k):
        calls["count"] += 1
        if calls["count"] == 2:
            whole = io.BytesIO()
            original_save(obj, whole, *a, **k)
            f.write(whole.getvalue()[:100])  # a partly written file, then the process dies
            raise SimulatedKill("the process dies during the save")
        return original_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save_that_dies_on_the_second_checkpoint)
    with pytest.raises(SimulatedKill):
        pretrain_gpt.main(args)
    monkeypatch.setattr(torch, "save", original_save)
    assert (save_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    resumed = pretrain_gpt.main(args + ["--load", str(save_dir)])
    assert len(resumed.losses) == 5 and resumed.iteration == 10


def test_sharded_checkpoint_cut_mid_save_is_ignored(data_prefix, tmp_path, monkeypatch):
    """A torch_dist save killed after the ranks wrote their chunks, before it was complete."""
    save_dir = tmp_path / "ckpt"
    args = tiny_gpt_args(
        data_prefix, "--save", str(save_dir), "--save-interval", "5", train_iters=10
    )
    original = torch_dist._write_common
    calls = {"count": 0}

    def write_common_that_dies_on_the_second_checkpoint(directory, common):
        calls["count"] += 1
        if calls["count"] == 2:
            raise SimulatedKill("the process dies during the save")
        return original(directory, common)

    monkeypatch.setattr(
        torch_dist, "_write_common", write_common_that_dies_on_the_second_checkpoint
    )
    with pytest.raises(SimulatedKill):
        pretrain_gpt.main(args)
    monkeypatch.setattr(torch_dist, "_write_common", original)
    assert (save_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    assert any(".tmp-" in name for name in os.listdir(save_dir))  # the cut-off save's files
    resumed = pretrain_gpt.main(args + ["--load", str(save_dir)])
    assert len(resumed.losses) == 5 and resumed.iteration == 10
    assert sorted(os.listdir(save_dir)) == [
        "iter_0000005", "iter_0000010", "latest_checkpointed_iteration.txt"
    ]  # fmt: skip


def _losses_of(output):
    return [(int(iteration), float(loss)) for iteration, loss in LOSS_PATTERN.findall(output)]


def _ranks_losses(nproc, args, log_path):
    """pretrain_gpt.py on `nproc` gloo ranks as torchrun starts them: its losses by iteration."""
    completed = processes.run(args, nproc, env=dict(os.environ, OMP_NUM_THREADS="1"))
    log_path.write_text(completed.stdout + completed.stderr)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return _losses_of(completed.stdout)


def _torchrun_losses(nproc, args, log_path):
    """The same under torchrun itself, as a user launches it."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    command += [
        "--master_addr=127.0.0.1",
        f"--master_port={processes.free_port()}",
        str(REPO / "pretrain_gpt.py"),
        *args,
    ]
    environment = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    completed = subprocess.run(
        command, capture_output=True, text=True, env=environment, timeout=600
    )
    log_path.write_text(completed.stdout + completed.stderr)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return _losses_of(completed.stdout)


@pytest.fixture(scope="module")
def single_rank(data_prefix, tmp_path_factory):
    """The 8-iteration run the parallel layouts below are compared with: (its flags, its losses
    by iteration, its log)."""
    args = tiny_gpt_args(data_prefix, train_iters=8)
    log = tmp_path_factory.mktemp("single_rank") / "single.log"
    return args, _ranks_losses(1, args, log), log


def test_data_parallel_matches_single_process(single_rank, tmp_path):
    """2 gloo ranks under torchrun x micro batch 4 == 1 rank x 2 micro-batches of 4, at global
    batch 8, in fp32."""
    args, single, _ = single_rank
    parallel = _torchrun_losses(2, args, tmp_path / "parallel.log")
    assert [iteration for iteration, _ in single] == list(range(1, 9))
    assert [iteration for iteration, _ in parallel] == list(range(1, 9))
    for (_, one), (_, two) in zip(single, parallel):
        assert abs(one - two) <= 1e-5 * abs(one), (single, parallel)


GRAD_NORM_PATTERN = re.compile(r" iteration +(\d+)/ +\d+ \|.* grad norm: ([0-9.E+-]+) \|")


def _close(first, second, tolerance=1e-5):
    return all(abs(one - two) <= tolerance * abs(one) for one, two in zip(first, second))


def test_distributed_optimizer_matches_single_process_and_resumes_across_layouts(
    single_rank, tmp_path
):
    """--use-distributed-optimizer at 2 gloo ranks gives 1 process's losses and grad norms; a
    checkpoint saved sharded at DP=2 resumes at 1 process (plain optimizer), and one saved at
    1 process resumes sharded at DP=2, both continuing the uninterrupted run."""
    args, single, single_log = single_rank
    sharded_log = tmp_path / "sharded.log"
    sharded = _ranks_losses(2, [*args, "--use-distributed-optimizer"], sharded_log)
    assert [iteration for iteration, _ in sharded] == list(range(1, 9))
    assert _close([loss for _, loss in single], [loss for _, loss in sharded]), (single, sharded)
    norms = [GRAD_NORM_PATTERN.findall(log.read_text()) for log in (single_log, sharded_log)]
    assert len(norms[0]) == 8
    # The log prints 3 decimals, so equal norms may differ by one unit in the last digit; the
    # unrounded norms agree within 1e-5 in tests/optimizer/test_distributed_optimizer.py.
    for (_, one), (_, two) in zip(*norms):
        assert abs(float(one) - float(two)) <= 1.001e-3, norms
    assert "distributed optimizer:" in sharded_log.read_text()

    for first, second, name in ((2, 1, "dp2_to_dp1"), (1, 2, "dp1_to_dp2")):
        save_dir = tmp_path / name
        checkpointing = ["--save", str(save_dir), "--load", str(save_dir), "--save-interval", "4"]
        first_args = [*args, *checkpointing, "--exit-interval", "4"]
        second_args = [*args, *checkpointing]
        if first == 2:
            first_args.append("--use-distributed-optimizer")
        else:
            # More ranks than saved RNG states: the run says to skip them (no dropout here).
            second_args += ["--use-distributed-optimizer", "--no-load-rng"]
        head = _ranks_losses(first, first_args, tmp_path / f"{name}_head.log")
        tail = _ranks_losses(second, second_args, tmp_path / f"{name}_tail.log")
        assert [iteration for iteration, _ in head + tail] == list(range(1, 9)), (head, tail)
        resumed = [loss for _, loss in head + tail]
        assert _close([loss for _, loss in single], resumed), (name, single, head + tail)


def test_sigterm_saves_and_exits(data_prefix, tmp_path):
    save_dir = tmp_path / "ckpt"
    args = tiny_gpt_args(
        data_prefix, "--save", str(save_dir), "--exit-signal-handler", train_iters=100000
    )
    args += ["--save-interval", "100000", "--tensorboard-dir", str(tmp_path / "tb")]
    with processes.start(args) as run:
        while run.poll() is None:
            iterations = [int(iteration) for iteration, _ in LOSS_PATTERN.findall(run.stdout())]
            if iterations and iterations[-1] >= 3:
                os.kill(run.pids[0], signal.SIGTERM)
                break
            time.sleep(0.05)
        returncode = run.wait(timeout=300)
        output = run.stdout() + run.stderr()
    assert returncode == 0, output[-3000:]
    match = re.search(r"exiting program after receiving SIGTERM at iteration (\d+)", output)
    assert match, output[-3000:]
    assert (save_dir / "latest_checkpointed_iteration.txt").read_text().strip() == match.group(1)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*")), "no TensorBoard event file"


class _Writes(io.StringIO):
    """A stream that keeps each write's text, as an unbuffered stream (python -u) turns each
    write into one system call."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def test_every_line_is_written_whole(data_prefix, tmp_path, monkeypatch):
    """Each line a run prints goes out with its newline in one write, so that under torchrun,
    with unbuffered streams, another rank's line cannot land inside it (`... at iteration
    6error: ...`, when print wrote the text and the newline apart): the log lines of a run that
    trains, evaluates, saves and resumes, and the error line of one that stops."""
    stdout, stderr = _Writes(), _Writes()
    monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.setattr(sys, "stderr", stderr)
    save = tmp_path / "ckpt"
    saving = ["--save", str(save), "--save-interval", "2", "--eval-interval", "2"]
    pretrain_gpt.main(tiny_gpt_args(data_prefix, *saving, "--exit-interval", "2", train_iters=4))
    pretrain_gpt.main(tiny_gpt_args(data_prefix, *saving, "--load", str(save), train_iters=4))
    (save / "latest_checkpointed_iteration.txt").write_text("6")  # no such checkpoint
    with pytest.raises(SystemExit):
        pretrain_gpt.main(tiny_gpt_args(data_prefix, "--load", str(save), train_iters=8))
    assert any("loaded checkpoint" in text for text in stdout.writes)
    assert [text for text in stderr.writes if text.startswith("error: ")]
    for stream in (stdout, stderr):
        torn = [text for text in stream.writes if not text.endswith("\n")]
        assert not torn, torn[:5]
