"""Host memory of each rank while it saves, in each checkpoint format (CPU, gloo).

    python -m bench.checkpoint_memory [--ranks 4] [--hidden-size 512] [--num-layers 6]

Each of the ranks (tensor parallel 2 x data parallel 2 by default, with the distributed
optimizer) builds its shards of a GPT model, gives it Adam state, and saves it once as
torch_dist and once as torch, while a thread samples its resident memory every millisecond.
A rank's *share* is what it holds of the state: its parameter shards and its optimizer state.
The table gives each save's extra memory (the peak during the save minus the resident memory
just before it) and share + extra over share: what saving makes the rank hold at its peak,
relative to its own state. torch_dist writes views of the rank's tensors; torch gathers the
whole model and optimizer state into rank 0 first.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
import threading
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron.checkpointing import save_checkpoint
from megatron.config import CheckpointConfig, ModelConfig, OptimizerConfig, TrainingConfig
from megatron.model import GPTModel
from megatron.optimizer.distributed_optimizer import build_distributed_optimizer
from megatron.parallel import parallel_state
from megatron.parallel.parallel_state import initialize_model_parallel
from megatron.parallelize.steps import shard_model

PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * PAGE


class PeakSampler:
    """The highest resident memory seen while the `with` block runs."""

    def __enter__(self) -> PeakSampler:
        self.before = resident_bytes()
        self.peak = self.before
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while self._running:
            self.peak = max(self.peak, resident_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self._running = False
        self._thread.join()
        self.peak = max(self.peak, resident_bytes())


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )  # fmt: skip
    initialize_model_parallel(args.tensor_parallel)
    config = ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=8,
        ffn_hidden_size=4 * args.hidden_size, seq_length=128, max_position_embeddings=128,
        padded_vocab_size=50304, tensor_model_parallel_size=args.tensor_parallel,
    )  # fmt: skip
    with torch.device("meta"):
        model = GPTModel(config)
    model = shard_model(model, config)
    optimizer = build_distributed_optimizer(
        model,
        OptimizerConfig(lr=1e-4),
        TrainingConfig(
            micro_batch_size=1, global_batch_size=world, num_micro_batches=1, train_iters=1
        ),
        parallel_state.get_data_parallel_group(),
    )
    for param in model.parameters():
        param.grad.zero_()
    optimizer.step()
    state_bytes = sum(
        value.numel() * value.element_size()
        for entry in optimizer.optimizer.state.values()
        for value in entry.values()
        if torch.is_tensor(value) and value.dim() > 0
    )
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    share = state_bytes + param_bytes
    results = {"share": share, "whole": None}
    for ckpt_format in ("torch_dist", "torch"):
        checkpoint = replace(
            CheckpointConfig(), save=os.path.join(out, ckpt_format), ckpt_format=ckpt_format
        )
        dist.barrier()
        with PeakSampler() as sampler:
            save_checkpoint(checkpoint, 1, model, optimizer, None, print_fn=lambda _: None)
        results[ckpt_format] = sampler.peak - sampler.before
    totals = [None] * world
    dist.all_gather_object(totals, results)
    if rank == 0:
        whole = sum(
            os.path.getsize(os.path.join(root, name))
            for root, _, names in os.walk(os.path.join(out, "torch"))
            for name in names
        )
        mib = 1 << 20
        print(f"\nstate saved: {whole / mib:.0f} MiB (the torch format's file); "
              f"{world} ranks, tensor parallel {args.tensor_parallel}")  # fmt: skip
        print(f"{'rank':>4} {'share MiB':>10} {'torch_dist extra':>17} {'(share+extra)/share':>20} "
              f"{'torch extra':>12} {'(share+extra)/share':>20}")  # fmt: skip
        for index, row in enumerate(totals):
            print(
                f"{index:>4} {row['share'] / mib:10.0f} {row['torch_dist'] / mib:17.0f} "
                f"{(row['share'] + row['torch_dist']) / row['share']:20.2f} "
                f"{row['torch'] / mib:12.0f} {(row['share'] + row['torch']) / row['share']:20.2f}"
            )
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tensor-parallel", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.start_processes(
            rank_main, args=(args.ranks, port, args, out), nprocs=args.ranks, start_method="fork"
        )


if __name__ == "__main__":
    main()
