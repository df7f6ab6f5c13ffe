"""Two torchrun agents on this machine as two nodes (--nnodes 2, 2 gloo ranks each) run a
TP=2 x DP=2 dMoE job that saves sharded checkpoints; one process resumes its iteration 2 and
continues to the two-node run's losses and grad norms. docs/training.md shows the same launch
across real nodes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tests import processes
from tests.moe.test_expert_parallel_gpt import moe_gpt_args
from tests.processes import free_port
from tests.sample_data import REPO
from tests.tiny_gpt import tensorboard_scalars

SCALARS = ("lm loss", "grad-norm")
TOLERANCE = 1e-5


def test_two_node_sharded_checkpoint_resumes_in_one_process(data_prefix, tmp_path):
    args = moe_gpt_args(data_prefix, "--tensor-model-parallel-size", "2",
                        "--make-vocab-size-divisible-by", "64", "--train-iters", "4",
                        "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
                        "--tensorboard-dir", str(tmp_path / "tb"))  # fmt: skip
    port = free_port()
    environment = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node_rank={node}",
                "--nproc_per_node=2",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                str(REPO / "pretrain_gpt.py"),
                *args,
            ],  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=environment,
        )
        for node in (0, 1)
    ]
    outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    for agent, output in zip(agents, outputs):
        assert agent.returncode == 0, output[-4000:]
    assert "data-parallel size: 2, tensor-model-parallel size: 2" in outputs[0]
    two_nodes = tensorboard_scalars(tmp_path / "tb", SCALARS)
    assert sorted(os.listdir(tmp_path / "ckpt" / "iter_0000004")) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp",
        "checksums.json", "common.pt", "metadata.json",
    ]  # fmt: skip

    load = tmp_path / "load"
    load.mkdir()
    shutil.copytree(tmp_path / "ckpt" / "iter_0000002", load / "iter_0000002")
    (load / "latest_checkpointed_iteration.txt").write_text("2")
    resume = moe_gpt_args(data_prefix, "--make-vocab-size-divisible-by", "128",
                          "--train-iters", "4", "--load", str(load),
                          "--tensorboard-dir", str(tmp_path / "tb1"))  # fmt: skip
    completed = processes.run(resume, env=environment, timeout=300)
    assert completed.returncode == 0, completed.stderr[-4000:]
    one_process = tensorboard_scalars(tmp_path / "tb1", SCALARS)
    for name in SCALARS:
        assert sorted(one_process[name]) == [3, 4], one_process
        for step in (3, 4):
            expected, actual = two_nodes[name][step], one_process[name][step]
            assert abs(actual - expected) <= TOLERANCE * abs(expected), (name, step)
