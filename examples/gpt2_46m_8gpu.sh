#!/usr/bin/env bash
# GPT-2 46M (6 layers, hidden 512, 8 heads) on 8 GPUs, MegaBlocks' hyper-parameters:
# global batch 512 x 1024 tokens, micro batch 64, 100k iterations.
# Usage: examples/gpt2_46m_8gpu.sh [DATA_PATH [VOCAB_FILE [MERGE_FILE [OUTPUT_DIR]]]] [pretrain_gpt.py flags...]
# (details in examples/common.sh and docs/examples.md)
set -euo pipefail

NPROC_PER_NODE=${NPROC_PER_NODE:-8}
MODEL_ARGS=(--num-layers 6 --hidden-size 512 --num-attention-heads 8 --init-method-std 0.01)
BATCH_ARGS=(--micro-batch-size 64 --lr 0.0006 --min-lr 0.00006)

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
launch_pretraining gpt2_46m_8gpu "$@"
