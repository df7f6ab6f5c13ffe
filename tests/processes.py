"""pretrain_gpt.py (or any script of the project) in processes of its own, started cheaply.

A test that needs a run in separate processes (several ranks, a signal, a file-size limit, a
kill) would pay a fresh interpreter each time: importing torch and the project costs seconds
per process, more than a tiny run's training, and torchrun adds its own interpreter and agent.
Here a multiprocessing fork server imports the project once per test process; each rank is a
fork of it that sets the environment torchrun gives a worker (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, ...), redirects its stdout and stderr to files, and runs the script
as `python script.py args` would (`runpy`, `__main__`, `sys.argv`; SystemExit gives the exit
code, an exception its traceback and 1). A rank is a real process with its own pid, so signals,
kills and resource limits act on it as on a launched one. As torchrun does, the first rank to
fail stops the others.

What torchrun itself does (the elastic agent, restarts, several nodes) is tested with torchrun:
tests/parallel/test_multi_node.py and tests/gpt_pretraining/test_pretrain_gpt.py.
"""

from __future__ import annotations

import atexit
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import runpy
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from tests.sample_data import REPO

PRETRAIN_GPT = str(REPO / "pretrain_gpt.py")

# Imported once by the fork server, inherited by every rank. "__main__" (pytest's, where it has
# a file) keeps each rank from importing it again, as multiprocessing's children otherwise do.
PRELOAD = ["__main__", "pretrain_gpt", "tests.processes"]

_context: Optional[multiprocessing.context.BaseContext] = None


def _fork_server() -> multiprocessing.context.BaseContext:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


@dataclasses.dataclass
class Finished:
    """What subprocess.run(capture_output=True) gives: the ranks' output, rank by rank."""

    returncode: int
    stdout: str
    stderr: str


class Ranks:
    """`nproc` ranks of one script; `wait` for them, `stdout` to read what they printed."""

    def __init__(
        self,
        script: str,
        args: Sequence[str],
        nproc: Optional[int],
        env: Mapping[str, str],
        before: Optional[Callable[[], None]],
    ) -> None:
        self._logs = tempfile.TemporaryDirectory(prefix="ranks_")
        self._directory = Path(self._logs.name)
        environment = dict(env)
        environment.setdefault("PYTHONPATH", str(REPO))
        environments = [environment]
        if nproc is not None:
            if nproc > 1:
                environment.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it
            port = free_port()
            environments = [
                dict(
                    environment,
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    WORLD_SIZE=str(nproc),
                    LOCAL_WORLD_SIZE=str(nproc),
                    GROUP_RANK="0",
                    ROLE_RANK=str(rank),
                    ROLE_WORLD_SIZE=str(nproc),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                    TORCHELASTIC_RESTART_COUNT="0",
                    TORCHELASTIC_MAX_RESTARTS="0",
                )
                for rank in range(nproc)
            ]
        self.processes = []
        for rank, rank_environment in enumerate(environments):
            log_directory = str(self._directory / str(rank))
            process = _fork_server().Process(
                target=_run_script,
                args=(script, list(args), rank_environment, log_directory, before),
                name=f"rank{rank}",
            )
            process.start()
            self.processes.append(process)

    @property
    def pids(self) -> List[int]:
        return [process.pid for process in self.processes]

    def poll(self) -> Optional[int]:
        """None while any rank runs; else the exit code: the first failed rank's, or 0."""
        codes = [process.exitcode for process in self.processes]
        failed = [code for code in codes if code not in (None, 0)]
        if failed:
            self._stop_the_rest()
            return failed[0]  # a signal as -N, as subprocess reports it
        return None if None in codes else 0

    def wait(self, timeout: Optional[float] = None) -> int:
        """The exit code; on `timeout` every rank is killed and TimeoutError raised."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self.kill()
                raise TimeoutError(
                    f"ranks still running after {timeout} s:\n{self.stdout()[-3000:]}"
                )
            sentinels = [process.sentinel for process in self.processes if process.exitcode is None]
            multiprocessing.connection.wait(sentinels, timeout=left)
        for process in self.processes:
            process.join()
        return code

    def kill(self, signal_number: int = signal.SIGKILL) -> None:
        """Send `signal_number` to every rank still running, then wait for them all."""
        for process in self.processes:
            if process.exitcode is None:
                try:
                    os.kill(process.pid, signal_number)
                except ProcessLookupError:  # it ended meanwhile
                    pass
        for process in self.processes:
            process.join()

    def stdout(self) -> str:
        return self._read("stdout")

    def stderr(self) -> str:
        return self._read("stderr")

    def _read(self, stream: str) -> str:
        return "".join(
            (self._directory / str(rank) / stream).read_text(errors="replace")
            if (self._directory / str(rank) / stream).exists()
            else ""
            for rank in range(len(self.processes))
        )

    def _stop_the_rest(self) -> None:
        for process in self.processes:
            if process.exitcode is None:
                process.kill()
                process.join()

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc_info) -> None:
        self.kill()
        self._logs.cleanup()


def start(
    args: Sequence[str],
    nproc: Optional[int] = None,
    script: str = PRETRAIN_GPT,
    env: Optional[Mapping[str, str]] = None,
    before: Optional[Callable[[], None]] = None,
) -> Ranks:
    """Start `script args` (pretrain_gpt.py by default) as `python script args` would, or with
    `nproc` as `torchrun --nproc_per_node nproc script args` would; in this test process's
    environment, or `env`. `before` (a module-level function) runs in each process first, as
    subprocess's preexec_fn."""
    return Ranks(script, args, nproc, os.environ if env is None else env, before)


def run(
    args: Sequence[str],
    nproc: Optional[int] = None,
    script: str = PRETRAIN_GPT,
    env: Optional[Mapping[str, str]] = None,
    before: Optional[Callable[[], None]] = None,
    timeout: float = 600,
) -> Finished:
    """`start`, then wait for every rank: the exit code and what the ranks printed."""
    with start(args, nproc, script, env, before) as ranks:
        code = ranks.wait(timeout)
        return Finished(code, ranks.stdout(), ranks.stderr())


def free_port() -> int:
    """A port nobody listens on now; rank 0's store binds it a moment later."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _redirect(fd: int, path: Path) -> None:
    file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(file, fd)
    os.close(file)


def _run_script(
    script: str,
    args: List[str],
    environment: Dict[str, str],
    log_directory: str,
    before: Optional[Callable[[], None]],
) -> None:
    """One rank, in a fork of the fork server: the environment, the output files, the script."""
    import torch

    Path(log_directory).mkdir(parents=True)
    _redirect(1, Path(log_directory) / "stdout")
    _redirect(2, Path(log_directory) / "stderr")
    sys.stdout.reconfigure(line_buffering=True)  # lines reach the file as a terminal shows them
    os.environ.clear()
    os.environ.update(environment)
    if "OMP_NUM_THREADS" in environment:
        # torch read it when the fork server imported it.
        torch.set_num_threads(int(environment["OMP_NUM_THREADS"]))
    if before is not None:
        before()
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        # What an interpreter runs at exit; multiprocessing's children skip it.
        atexit._run_exitfuncs()
