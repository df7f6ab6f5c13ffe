"""What checksums cost a checkpoint: save with and without them, verify, load with and without.

Builds the model of pretrain_gpt.py's flags on this machine's device, gives it Adam state (one
optimizer step on zero gradients), and times `megatron.checkpointing` on it, one checkpoint on
disk at a time (the dMoE 125M's is 42 GB):

    python -m bench.checkpoint_io --save-dir /tmp/ckpt -- \\
        --num-layers 12 --hidden-size 768 --num-attention-heads 12 --moe-num-experts 64 ... \\
        --vocab-file data/sample/gpt2-vocab.json --merge-file data/sample/gpt2-merges.txt

Saves with and without checksums alternate (--repeats of each). Loads read the file written
just before, from the page cache when it fits in memory; with --drop-caches each load and the
verification start from a cold cache (needs root).
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from dataclasses import replace

import torch

from gpt_pretraining import GPT_RUN
from megatron.checkpointing import checkpoint_file, load_checkpoint, save_checkpoint
from megatron.checkpointing.checksums import (
    CHECKSUMS_FILENAME,
    find_damage,
    read_manifest,
)
from megatron.initialize import initialize_model_parallel
from megatron.optimizer import build_lr_scheduler, build_optimizer

ITERATION = 4


def build(flags, device):
    """The model, optimizer (with Adam state) and scheduler of pretrain_gpt.py's `flags`."""
    config, _ = GPT_RUN.config_from_argv(flags, 1, tokenizer_log=print)
    initialize_model_parallel(1)
    model = GPT_RUN.model(config).to(device)
    optimizer = build_optimizer(model, config.optimizer, config.training)
    scheduler = build_lr_scheduler(optimizer, config.optimizer, config.training)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    optimizer.zero_grad()
    return config, config.saved_arguments(), model, optimizer, scheduler


def drop_caches() -> bool:
    """Empty the page cache so the next read comes from the disk; False where not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as file:
            file.write("3\n")
    except OSError as error:
        print(f"note: cannot drop the page cache ({error}); loads read a warm cache")
        return False
    return True


def timed(function) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    function()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--save-dir", required=True, help="emptied first; one checkpoint at a time")
    parser.add_argument("--drop-caches", action="store_true", help="cold page cache before loads")
    parser.add_argument("--repeats", type=int, default=2, help="saves of each kind, alternated")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="pretrain_gpt.py flags after --")
    args = parser.parse_args()
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config, run_arguments, model, optimizer, scheduler = build(flags, device)
    shutil.rmtree(args.save_dir, ignore_errors=True)
    # The single-file format, whose checksums this measures (bench/checkpoint_formats.py
    # compares the formats).
    checkpoint = replace(
        config.checkpoint, save=args.save_dir, load=args.save_dir, ckpt_format="torch"
    )

    def save(checksums: bool) -> float:
        return timed(
            lambda: save_checkpoint(
                checkpoint, ITERATION, model, optimizer, scheduler, run_arguments,
                checksums=checksums,
            )
        )  # fmt: skip

    def load() -> float:
        if args.drop_caches:
            args.drop_caches = drop_caches()
        # A resumed run loads into an optimizer without state: free this one's first, or its
        # moments and the loaded ones would both be on the device.
        optimizer.optimizer.state.clear()
        return timed(
            lambda: load_checkpoint(checkpoint, model, optimizer, scheduler, args=run_arguments)
        )

    rows = []
    path = checkpoint_file(args.save_dir, ITERATION)
    # Alternated, so that neither kind of save gets the first-save costs (host memory first
    # touched, caches cold) every time.
    for repeat in range(args.repeats):
        rows.append(("save, no checksums", save(checksums=False)))
        shutil.rmtree(args.save_dir)
        rows.append(("save, checksums recorded", save(checksums=True)))
        if repeat + 1 < args.repeats:
            shutil.rmtree(args.save_dir)
    size = os.path.getsize(path)
    directory = os.path.dirname(os.path.dirname(path))
    manifest = read_manifest(directory)
    expected = manifest.files[os.path.relpath(path, directory)]
    if args.drop_caches:
        args.drop_caches = drop_caches()
    rows.append(
        ("verify checksums only", timed(lambda: find_damage(path, expected, manifest.block_size)))
    )
    rows.append(("load, checksums verified", load()))
    os.remove(os.path.join(directory, CHECKSUMS_FILENAME))
    rows.append(("load, unverified", load()))
    shutil.rmtree(args.save_dir)

    print(
        f"\ncheckpoint file: {size / 1e9:.2f} GB; device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}"
    )
    print(f"{'step':<28} {'seconds':>8} {'GB/s':>7}")
    for name, seconds in rows:
        print(f"{name:<28} {seconds:8.2f} {size / 1e9 / seconds:7.2f}")


if __name__ == "__main__":
    main()
