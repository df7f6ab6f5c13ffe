#!/usr/bin/env bash
# The packages run_torchtitan_moe.sh installs that the device image lacks (it has torch 2.11,
# Triton, NumPy, pyarrow, pandas, tokenizers, huggingface_hub, tensorboard), downloaded on a
# machine with internet into DIR (default .tt/wheels, an ignored folder to carry to the device).
# torchtitan 0.3.0 needs a torch newer than 2.11 (it imports DataParallelMeshDims from
# torch.distributed.fsdp); 0.2.2 runs on 2.11.
set -euo pipefail
DIR=${1:-.tt/wheels}
mkdir -p "$DIR"
python3 -m pip download --no-deps -d "$DIR" \
    torchtitan==0.2.2 torchdata==0.11.0 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18 \
    tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 fsspec==2026.2.0 \
    --python-version 3.12 --only-binary=:all:
du -sh "$DIR"
