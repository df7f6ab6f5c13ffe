"""tests/launch.py's in-process launcher on the CPU: `pretrain_on_gpus(1, ...)` runs
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

import pytest
import torch.distributed as dist

from tests.launch import pretrain_on_gpus
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
