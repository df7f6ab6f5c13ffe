#!/usr/bin/env bash
# GPT-2 1315M (24 layers, hidden 2048, 16 heads) on 8 GPUs, MegaBlocks' hyper-parameters:
# global batch 512 x 1024 tokens, micro batch 16, 100k iterations.
# Usage: examples/gpt2_1315m_8gpu.sh [DATA_PATH [VOCAB_FILE [MERGE_FILE [OUTPUT_DIR]]]] [pretrain_gpt.py flags...]
# (details in examples/common.sh and docs/examples.md)
set -euo pipefail

NPROC_PER_NODE=${NPROC_PER_NODE:-8}
# MegaBlocks keeps the default --init-method-std (0.02) at this size.
MODEL_ARGS=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16)
BATCH_ARGS=(--micro-batch-size 16 --lr 0.0004 --min-lr 0.00004)

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
launch_pretraining gpt2_1315m_8gpu "$@"
