#!/usr/bin/env bash
# GPT-2 356M (24 layers, hidden 1024, 16 heads) on 1 GPU, MegaBlocks' hyper-parameters:
# global batch 512 x 1024 tokens, micro batch 16, 100k iterations.
# Usage: examples/gpt2_356m_1gpu.sh [DATA_PATH [VOCAB_FILE [MERGE_FILE [OUTPUT_DIR]]]] [pretrain_gpt.py flags...]
# (details in examples/common.sh and docs/examples.md)
set -euo pipefail

NPROC_PER_NODE=${NPROC_PER_NODE:-1}
MODEL_ARGS=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --init-method-std 0.01)
# Same recipe as the 8-GPU script (same global batch), with more gradient accumulation.
BATCH_ARGS=(--micro-batch-size 16 --lr 0.0006 --min-lr 0.00006)

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
launch_pretraining gpt2_356m_1gpu "$@"
