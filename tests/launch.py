"""Launchers for multi-process tests on CPU (gloo).

``run_distributed`` runs a test function in N forked gloo processes and hands back what each
rank returned; ``pretrain_ranks`` runs pretrain_gpt.py on N ranks as torchrun would;
``pretrain_on_gpus`` runs it for the gpu-marked tests on N GPUs under torchrun itself (NCCL),
or as torchrun's one rank in this process, on the device torch sees (a GPU; the CPU on gloo in
tests/test_launch.py).

Usage of ``run_distributed``::

    def _check(rank: int, world_size: int, scale: float) -> float:
        # torch.distributed is initialized (gloo) here; rank/world_size match dist.get_rank() etc.
        x = torch.full((2,), float(rank) * scale)
        dist.all_reduce(x)
        return x.sum().item()

    def test_sum():
        assert run_distributed(_check, 2, 0.5) == [1.0, 1.0]

Rules for ``fn``:
- it is called as ``fn(rank, world_size, *args)`` after ``init_process_group("gloo")``; then
  the ranks meet at a barrier and end (the group is not destroyed, see ``_child``);
- it must be a module-level function (so it pickles when the children are spawned), and its
  return value must be picklable by ``torch.save`` (tensors, numbers, lists, dicts...);
- an exception in any rank fails the test with that rank's traceback, and the other ranks are
  terminated (a rank blocked in a collective does not hang the test: the group has a timeout).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests import processes
from tests.processes import free_port
from tests.tiny_gpt import tensorboard_scalars


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; return results by rank."""
    with tempfile.TemporaryDirectory(prefix="run_distributed_") as result_dir:
        # fork skips re-importing torch in every child (most of a small test's time); a process
        # that has initialized CUDA cannot fork, so it spawns instead.
        start_method = "spawn" if torch.cuda.is_initialized() else "fork"
        mp.start_processes(
            _child,
            args=(world_size, free_port(), timeout_s, result_dir, fn, args),
            nprocs=world_size,
            join=True,
            start_method=start_method,
        )
        return [
            torch.load(_result_path(result_dir, rank), weights_only=False)
            for rank in range(world_size)
        ]


def _child(
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    result_dir: str,
    fn: Callable[..., Any],
    args: tuple,
) -> None:
    # Several ranks share two cores: one intra-op thread each avoids oversubscription stalls.
    torch.set_num_threads(1)
    # A forked rank inherits the parent's Inductor compile thread pool without its threads
    # (Inductor resets only its process pool after a fork), so a kernel compiled there would
    # wait forever for a thread that is gone: compile in this process instead. A parent that
    # never imported Inductor has no pool to inherit.
    inductor_config = sys.modules.get("torch._inductor.config")
    if inductor_config is not None:
        inductor_config.compile_threads = 1
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    result = fn(rank, world_size, *args)
    # Results go through files rather than a pipe: a large result in a pipe would block the
    # child before the parent starts reading (it reads only after join).
    torch.save(result, _result_path(result_dir, rank))
    # No rank leaves while another may still talk to rank 0's store (a late new_group would find
    # it gone: "Connection reset by peer").
    dist.barrier()
    # The process group is not destroyed: the process ends without destructors. Before torch 2.8
    # ProcessGroupGloo's destructor joins its worker threads holding the GIL, and a worker that
    # drops the last reference to a collective's tensor waits for the GIL: the two deadlock now
    # and then (seen on torch 2.4; fixed by pytorch/pytorch#154976). A forked child ends through
    # os._exit anyway; a spawned one would run the destructors at interpreter exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _result_path(result_dir: str, rank: int) -> str:
    return os.path.join(result_dir, f"rank{rank}.pt")


def pretrain_ranks(
    nproc: int,
    args: list,
    tensorboard_dir: Path,
    scalars: Iterable[str] = ("lm loss", "grad-norm"),
) -> dict:
    """Run pretrain_gpt.py on `nproc` gloo ranks as torchrun would (tests/processes.py); its
    stdout and the per-iteration values of the TensorBoard `scalars` rank 0 logged
    ({name: {iteration: value}})."""
    finished = processes.run(
        [*args, "--tensorboard-dir", str(tensorboard_dir)],
        nproc,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        timeout=300,
    )
    assert finished.returncode == 0, (finished.stdout + finished.stderr)[-4000:]
    return {"stdout": finished.stdout, **tensorboard_scalars(tensorboard_dir, scalars)}


# NVLink multicast off, as the lent GPU machines require.
NO_NVLINK_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def pretrain_on_gpus(nproc: int, args: list, tensorboard_dir: Path, scalars: Iterable[str]) -> dict:
    """Run pretrain_gpt.py on `nproc` GPUs; its stdout and the per-iteration values of the
    TensorBoard `scalars` rank 0 logged ({name: {iteration: value}}).

    Several GPUs: under torchrun (NCCL, NVLink multicast off, as the lent machines require).
    One: in this process, as torchrun's one rank would run it (its environment, a process
    group of one), on the device torch sees (a GPU, or the CPU on gloo), so that the runs of a
    test session share one interpreter's imports, CUDA context and Inductor's caches instead of
    paying a process start each."""
    args = [*args, "--tensorboard-dir", str(tensorboard_dir)]
    if nproc == 1:
        import pretrain_gpt

        printed = io.StringIO()
        with _as_torchruns_only_rank(), contextlib.redirect_stdout(printed):
            pretrain_gpt.main(args)
        return {"stdout": printed.getvalue(), **tensorboard_scalars(tensorboard_dir, scalars)}
    repo_root = Path(__file__).resolve().parents[1]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc_per_node", str(nproc), str(repo_root / "pretrain_gpt.py"), *args,
    ]  # fmt: skip
    env = dict(os.environ, **NO_NVLINK_MULTICAST)
    done = subprocess.run(
        command, cwd=repo_root, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {"stdout": done.stdout, **tensorboard_scalars(tensorboard_dir, scalars)}


@contextlib.contextmanager
def _as_torchruns_only_rank():
    """The environment `torchrun --nproc_per_node 1` gives its worker, so the run joins a
    process group of one as it would there (--use-torch-fsdp2 needs one), and Dynamo's state as
    a fresh process has it (the run reports the graphs and breaks it compiled, from Dynamo's
    process-wide counters; Inductor's caches stay warm); afterwards the group is destroyed, the
    environment restored and the run's cached GPU memory given back (torchrun runs of several
    GPUs may follow on this GPU)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    saved = dict(os.environ)
    os.environ.update(
        WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), **NO_NVLINK_MULTICAST,
    )  # fmt: skip
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)
        gc.collect()
        torch.cuda.empty_cache()
