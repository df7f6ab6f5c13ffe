#!/usr/bin/env bash
# MoE with capacity factor 1 356m (24 layers, hidden 1024, 16 heads, 64 experts of ffn 4096, top-1) on 8 GPU(s),
# MegaBlocks' recipe: global batch 512 x 1024 tokens, micro batch 32, load-balancing loss weight 0.1.
# Usage: examples/moe_356m_8gpu.sh [DATA_PATH [VOCAB_FILE [MERGE_FILE [OUTPUT_DIR]]]] [pretrain_gpt.py flags...]
# (details in examples/common.sh, docs/examples.md and docs/moe.md)
set -euo pipefail

NPROC_PER_NODE=${NPROC_PER_NODE:-8}
MODEL_ARGS=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --init-method-std 0.01
    --moe-num-experts 64 --moe-top-k 1 --moe-loss-weight 0.1 --no-moe-dropless --moe-capacity-factor 1)
BATCH_ARGS=(--micro-batch-size 32 --lr 0.0006 --min-lr 0.00006)

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
launch_pretraining moe_356m_8gpu "$@"
