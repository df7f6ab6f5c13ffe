"""tests/launch.py's launchers on the CPU.

`run_distributed`'s forked ranks compile with Inductor after the parent used its compile
thread pool, whose threads do not survive the fork.

The in-process launcher: `pretrain_on_gpus(1, ...)` runs
pretrain_gpt.py in this process as torchrun's one rank would (a gloo process group of one
here, which --use-torch-fsdp2 needs), then leaves no group and the environment as it found it,
so a run after it starts afresh. Its other callers are GPU-marked: this is the test CI runs.

A tiny fp32 GPT, plain, under FSDP2 and plain again: FSDP2 at one rank gathers and
reduce-scatters over one rank, so its losses are the plain run's bit for bit, and its grad
norms within fp32's last bits (the square root of the summed squares of its DTensor shards,
where the plain run takes the norm of the per-tensor norms). The runs do not clip
(--clip-grad 0): a clipped step scales its update by the norm, and its last bit would then
reach the losses."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

from tests.launch import pretrain_on_gpus
from tests.sample_data import REPO
from tests.tiny_gpt import tiny_gpt_args

ITERATIONS = 4
SCALARS = ("lm loss", "grad-norm")
GRAD_NORM_TOLERANCE = 1e-6  # relative: the squares combined in another order
RUNS = {"plain": (), "fsdp2": ("--use-torch-fsdp2",), "plain_again": ()}


def test_one_rank_runs_in_this_process_as_torchruns_only_rank(data_prefix, tmp_path, monkeypatch):
    joined = []
    init_process_group = dist.init_process_group

    def recorded(*args, **kwargs):
        init_process_group(*args, **kwargs)
        joined.append((dist.get_backend(), dist.get_world_size()))

    monkeypatch.setattr(dist, "init_process_group", recorded)
    args = tiny_gpt_args(
        data_prefix, "--clip-grad", "0.0",
        seq_length=16, micro_batch=1, global_batch=4, train_iters=ITERATIONS, eval_iters=0,
    )  # fmt: skip
    environment = dict(os.environ)
    runs = {}
    for name, flags in RUNS.items():
        runs[name] = pretrain_on_gpus(1, [*args, *flags], tmp_path / name, SCALARS)
        assert joined == [("gloo", 1)], f"the {name} run joined {joined}, not one gloo group of 1"
        joined.clear()
        assert not dist.is_initialized(), f"the {name} run left its process group"
        assert dict(os.environ) == environment, f"the {name} run left the environment changed"
    plain, sharded = runs["plain"], runs["fsdp2"]
    assert sorted(plain["lm loss"]) == list(range(1, ITERATIONS + 1))
    assert runs["plain_again"]["lm loss"] == plain["lm loss"]
    assert runs["plain_again"]["grad-norm"] == plain["grad-norm"]
    assert sharded["lm loss"] == plain["lm loss"]
    for step in plain["grad-norm"]:
        assert sharded["grad-norm"][step] == pytest.approx(
            plain["grad-norm"][step], rel=GRAD_NORM_TOLERANCE
        ), step


# In a process of its own, so that a rank waiting forever fails the test at the timeout instead
# of holding the suite: the parent's compile pool gets an idle thread, then two forked ranks
# compile a kernel of a constant no earlier run compiled (a fresh C++ build, not a cache hit).
INHERITED_POOL = textwrap.dedent(
    """
    import random, torch
    from torch._inductor.async_compile import AsyncCompile
    from tests.launch import run_distributed

    def compile_in_rank(rank, world_size, constant):
        return torch.compile(lambda x: (x * constant).sin() + x.cos())(torch.ones(4)).tolist()

    assert AsyncCompile.pool().submit(lambda: 1).result() == 1
    first, second = run_distributed(compile_in_rank, 2, 2.0 + random.random())
    assert first == second, (first, second)
    """
)


def test_forked_ranks_compile_after_the_parent_used_inductors_pool():
    """Without compiling in the rank itself, the rank hands its C++ build to the inherited pool,
    whose thread is gone, and waits forever (the compiled-layer tests hung so under xdist)."""
    finished = subprocess.run(
        [sys.executable, "-c", INHERITED_POOL], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert finished.returncode == 0, finished.stderr[-3000:]
