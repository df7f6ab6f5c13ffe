"""The memory planner against measurement: each row runs pretrain_gpt.py for a few iterations
on one GPU and compares the start-up estimate with the peak the run reports.

    python -m bench.memory_plan                       # every row that the estimate says fits
    python -m bench.memory_plan --rows dmoe-125m-mb16 dmoe-125m-mb16-recompute --output r.json
    python -m bench.memory_plan --dry-run             # the commands and predictions, no GPU

Each run: 3 iterations of a global batch of 2 micro-batches (the accumulation path runs),
--log-interval 3 so that Megatron's one-time memory line (`[Rank 0] (after 3 iterations)
memory (MB) | allocated | max allocated | reserved | max reserved`, megatron.training) covers
iterations with optimizer state, no evaluation, no checkpoint, bf16, with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, on the bundled corpus (made by
examples/data_preprocessing.sh when missing). The table: predicted total (reserved) GiB, the
predicted allocated peak, the measured max allocated and max reserved GiB, and the error of
the predicted total against the measured max reserved. Rows the estimate says do not fit the
GPU are skipped unless --include-oom.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from gpt_pretraining import GPT_RUN
from megatron.memory_plan import GIB, estimate_memory

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_PREFIX = REPO_ROOT / "data" / "owt" / "owt_text_document"
VOCAB = REPO_ROOT / "data" / "sample" / "gpt2-vocab.json"
MERGES = REPO_ROOT / "data" / "sample" / "gpt2-merges.txt"
GPT2_125M = "--num-layers 12 --hidden-size 768 --num-attention-heads 12 --init-method-std 0.01"
GPT2_1315M = "--num-layers 24 --hidden-size 2048 --num-attention-heads 16"
DMOE_125M = (
    f"{GPT2_125M} --moe-num-experts 64 --moe-top-k 1 --moe-loss-weight 0.1 --moe-impl grouped"
)
RECOMPUTE = "--recompute-granularity full --recompute-method uniform"
PRECISION_AWARE = (
    "--use-precision-aware-optimizer --main-grads-dtype bf16 --exp-avg-dtype bf16 "
    "--exp-avg-sq-dtype bf16"
)
DISTRIBUTED = "--use-distributed-optimizer"
MEMORY_LINE = re.compile(
    r"max allocated: ([0-9.]+) \| reserved: [0-9.]+ \| max reserved: ([0-9.]+)"
)
ESTIMATE_LINE = re.compile(r"> estimated peak memory per GPU: ([0-9.]+) GiB")


def shared_flags(micro_batch: int) -> List[str]:
    """Everything but the model: 2 iterations of 4 micro-batches, the bundled corpus. Four, so
    that the gradients reach the state they hold in a long run's steps (a first pair of
    micro-batches creates the fp32 expert gradients; the next pair adds into them); two
    iterations, so that the peak includes the optimizer's state."""
    return (
        "--seq-length 1024 --max-position-embeddings 1024 --make-vocab-size-divisible-by 1024 "
        f"--micro-batch-size {micro_batch} --global-batch-size {4 * micro_batch} "
        "--train-iters 2 --log-interval 2 --eval-iters 0 --eval-interval 1000 --lr 6e-4 "
        "--lr-decay-style cosine --split 969,30,1 --tokenizer-type GPT2BPETokenizer --bf16 "
        f"--data-path {DATA_PREFIX} --vocab-file {VOCAB} --merge-file {MERGES}"
    ).split()


def rows() -> Dict[str, List[str]]:
    """Row name -> pretrain_gpt.py flags (the issue's list)."""
    models: List[Tuple[str, str, int]] = [
        ("gpt2-125m", GPT2_125M, 32),
        ("gpt2-1315m", GPT2_1315M, 8),
    ]
    models += [(f"dmoe-125m-mb{mb}", DMOE_125M, mb) for mb in (8, 16, 32, 64)]
    table = {}
    for name, model, micro_batch in models:
        for recompute in (False, True):
            for precision_aware in (False, True):
                row = (
                    name + ("-recompute" if recompute else "") + ("-pa" if precision_aware else "")
                )
                flags = model.split() + shared_flags(micro_batch)
                flags += RECOMPUTE.split() if recompute else []
                flags += PRECISION_AWARE.split() if precision_aware else []
                table[row] = flags
        # The distributed optimizer on one rank: bf16 weights beside whole fp32 masters.
        table[name + "-do"] = model.split() + shared_flags(micro_batch) + [DISTRIBUTED]
    return table


def predict(flags: List[str], device_memory: int) -> Tuple[float, float]:
    """(predicted total GiB, predicted allocated GiB) of one row."""
    config, _ = GPT_RUN.config_from_argv(flags, 1)
    estimate = estimate_memory(config, GPT_RUN.mlp_spec(config), device_memory)
    return estimate.total / GIB, estimate.allocated / GIB


def ensure_data() -> None:
    """Tokenize the bundled sample (examples/data_preprocessing.sh) when it is missing."""
    if not DATA_PREFIX.with_suffix(".idx").is_file():
        print("data/owt missing: running examples/data_preprocessing.sh", flush=True)
        subprocess.run(["bash", str(REPO_ROOT / "examples" / "data_preprocessing.sh")], check=True)


def run_row(flags: List[str]) -> Dict[str, Optional[float]]:
    """Run pretrain_gpt.py; its estimate and measured peaks in GiB (None if not printed)."""
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    command = [sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), *flags]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    output = done.stdout + done.stderr
    memory = MEMORY_LINE.search(output)
    estimate = ESTIMATE_LINE.search(output)
    result: Dict[str, Optional[float]] = {
        "returncode": float(done.returncode),
        "printed_estimate_gib": float(estimate.group(1)) if estimate else None,
        "max_allocated_gib": float(memory.group(1)) / 1024.0 if memory else None,
        "max_reserved_gib": float(memory.group(2)) / 1024.0 if memory else None,
    }
    if done.returncode != 0:
        result["error"] = output.strip().splitlines()[-1] if output.strip() else "no output"
    return result


def main(argv: Optional[List[str]] = None) -> int:
    """Run the rows; print the table; 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", help="row names (default: all)")
    parser.add_argument("--include-oom", action="store_true", help="run rows predicted not to fit")
    parser.add_argument("--output", help="write the results as JSON here")
    parser.add_argument("--dry-run", action="store_true", help="print commands and predictions")
    parser.add_argument(
        "--gpu-memory-gib", type=float, help="device memory (default: the GPU's, else 80)"
    )
    args = parser.parse_args(argv)
    table = rows()
    unknown = sorted(set(args.rows or []) - set(table))
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {sorted(table)}")
    selected = {name: table[name] for name in (args.rows or table)}
    device_memory = int((args.gpu_memory_gib or _gpu_memory_gib()) * GIB)
    if not args.dry_run:
        ensure_data()
    results = []
    header = f"{'row':32s} {'pred GiB':>9s} {'pred alloc':>10s} {'max alloc':>9s} {'max resv':>9s} {'err %':>7s}"
    print(header, flush=True)
    for name, flags in selected.items():
        total, allocated = predict(flags, device_memory)
        result = {"row": name, "predicted_gib": total, "predicted_allocated_gib": allocated}
        if args.dry_run:
            command = " ".join([sys.executable, "pretrain_gpt.py", *flags])
            print(f"{name:32s} {total:9.1f} {allocated:10.1f}\n    {command}", flush=True)
        elif total * GIB > device_memory and not args.include_oom:
            result["skipped"] = True
            print(f"{name:32s} skipped (predicted {total:.1f} GiB)", flush=True)
        else:
            result.update(run_row(flags))
            reserved = result.get("max_reserved_gib")
            error = 100.0 * (total - reserved) / reserved if reserved else None
            result["error_percent"] = error
            print(
                f"{name:32s} {total:9.1f} {allocated:10.1f} "
                f"{_cell(result.get('max_allocated_gib'))} {_cell(reserved)} "
                f"{_cell(error, '7.1f')}" + (f"  ({result['error']})" if "error" in result else ""),
                flush=True,
            )
        results.append(result)
        if args.output:  # after every row: a run cut short keeps the rows it finished
            Path(args.output).write_text(json.dumps(results, indent=2))
    return 0


def _cell(value: Optional[float], spec: str = "9.1f") -> str:
    width = int(spec.split(".")[0])
    return f"{value:{spec}}" if value is not None else "-".rjust(width)


def _gpu_memory_gib() -> float:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GIB
    return 80.0


if __name__ == "__main__":
    sys.exit(main())
