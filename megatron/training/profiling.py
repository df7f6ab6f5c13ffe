"""Megatron's --profile: record a few training iterations on chosen ranks.

With --use-pytorch-profiler the iterations are recorded by torch.profiler (CPU ops and, on GPUs,
kernels) into a trace for TensorBoard's profiler plugin or Perfetto, written to
--tensorboard-dir with a plain-text table of the costliest operations beside it. Without it, the
iterations are bracketed by CUDA's profiler start/stop and NVTX ranges, so that
`nsys profile --capture-range=cudaProfilerApi` records exactly those iterations.
"""

from __future__ import annotations

import os
from contextlib import ExitStack

import torch

from megatron.config import LoggingConfig
from megatron.console import print_line

TABLE_ROWS = 40


class StepProfiler:
    """Starts before iteration `profile_step_start + 1` and stops after `profile_step_end`."""

    def __init__(self, config: LoggingConfig, rank: int, device: torch.device):
        self.enabled = config.profile and rank in config.profile_ranks
        self.config = config
        self.rank = rank
        self.device = device
        self.active = False
        self._profiler: torch.profiler.profile | None = None
        self._nvtx = ExitStack()
        self._iteration = ExitStack()

    def before_step(self, iterations_done: int) -> None:
        if self.enabled and not self.active and iterations_done == self.config.profile_step_start:
            self._start()
        if self.active:
            # Megatron's 1-based iteration number names each step's span in the trace.
            self._iteration.enter_context(
                torch.profiler.record_function(f"iteration {iterations_done + 1}")
            )

    def _start(self) -> None:
        self.active = True
        if self.config.use_pytorch_profiler:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(
                activities=activities,
                record_shapes=True,
                on_trace_ready=torch.profiler.tensorboard_trace_handler(
                    self.config.tensorboard_dir, worker_name=f"rank{self.rank}"
                ),
            )
            self._profiler.start()
        else:
            torch.cuda.cudart().cudaProfilerStart()
            self._nvtx.enter_context(torch.autograd.profiler.emit_nvtx(record_shapes=True))

    def after_step(self, iterations_done: int) -> None:
        self._iteration.close()
        if self.active and iterations_done == self.config.profile_step_end:
            self.stop()

    def stop(self) -> None:
        """Ends the recording (also when training ends before --profile-step-end)."""
        self._iteration.close()
        if not self.active:
            return
        self.active = False
        if self._profiler is None:
            self._nvtx.close()
            torch.cuda.cudart().cudaProfilerStop()
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._profiler.stop()  # writes the trace through on_trace_ready
        path = self._write_table(self._profiler)
        self._profiler = None
        print_line(
            f"[Rank {self.rank}] profiled iterations {self.config.profile_step_start + 1}-"
            f"{self.config.profile_step_end}: trace in {self.config.tensorboard_dir}, "
            f"table in {path}"
        )

    def _write_table(self, profiler: torch.profiler.profile) -> str:
        directory = self.config.tensorboard_dir
        start, end = self.config.profile_step_start + 1, self.config.profile_step_end
        path = os.path.join(directory, f"profile_rank{self.rank}_iterations{start}-{end}.txt")
        # Costliest first by their own time on the device that ran them (torch 2.4 has the name).
        sort_by = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort_by, row_limit=TABLE_ROWS)
        temporary = path + ".tmp"
        with open(temporary, "w") as handle:
            handle.write(table + "\n")
        os.replace(temporary, path)
        return path
