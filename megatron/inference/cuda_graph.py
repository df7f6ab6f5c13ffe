"""One decode step of a model on its cache, replayed from a CUDA graph where it can be captured.

A decode step of a small model is hundreds of short kernels; launched one by one from Python
the host, not the GPU, sets the pace. `decode_step` has fixed shapes and keeps its state on the
device (megatron.inference.decode), so one capture replays for every step of every generation
that reuses the cache. Its input is a static token buffer the caller's token is copied into;
its output, the logits, is a static buffer overwritten by the next replay.

Capture is tried on CUDA devices only. When it fails (a module that reads a device value on the
host, such as an MoE layer with capacity, or an op that cannot be captured) the step runs
eagerly and `mode` says why; the results are the same either way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from megatron.inference.decode import decode_step
from megatron.inference.kv_cache import KVCache

if TYPE_CHECKING:
    from megatron.model import GPTModel

# Eager steps before the capture: lazy initialization (cuBLAS workspaces, Triton compilation
# and autotuning, SDPA backend selection) must happen outside the captured stream.
WARMUP_STEPS = 2


class DecodeStepRunner:
    """Runs `decode_step(model, cache, tokens)`: by graph replay when `use_cuda_graph` and the
    capture succeeded, else eagerly. `mode` is "CUDA graph", "eager" or "eager (CUDA graph
    capture failed: ...)".

    Capturing runs WARMUP_STEPS real steps, which write garbage into the cache and advance its
    decode state; build the runner before the prefill, which resets both.
    """

    def __init__(self, model: GPTModel, cache: KVCache, use_cuda_graph: bool = True) -> None:
        self.model = model
        self.cache = cache
        device = cache.key_valid.device
        self.tokens = torch.zeros(cache.batch_size, 1, dtype=torch.long, device=device)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.logits: Optional[torch.Tensor] = None
        self.mode = "eager"
        if use_cuda_graph and device.type == "cuda":
            self._capture()

    def _capture(self) -> None:
        side_stream = torch.cuda.Stream(device=self.tokens.device)
        side_stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side_stream):
                for _ in range(WARMUP_STEPS):
                    decode_step(self.model, self.cache, self.tokens)
            torch.cuda.current_stream().wait_stream(side_stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = decode_step(self.model, self.cache, self.tokens)
            torch.cuda.synchronize()
        except Exception as error:  # any failure falls back to the eager step
            torch.cuda.synchronize()
            reason = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            self.mode = f"eager (CUDA graph capture failed: {type(error).__name__}: {reason})"
            return
        self.graph, self.logits = graph, logits
        self.mode = "CUDA graph"

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed tokens [b] (or [b, 1]) and return the logits [b, vocab] of the step; with a
        graph they are a buffer the next call overwrites."""
        self.tokens.copy_(tokens.view(-1, 1))
        if self.graph is None:
            return decode_step(self.model, self.cache, self.tokens)
        self.graph.replay()
        return self.logits
