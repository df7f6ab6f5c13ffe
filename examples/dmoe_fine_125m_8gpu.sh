#!/usr/bin/env bash
# Fine-grained dMoE 125m (12 layers, hidden 768, 12 heads, 256 experts of ffn 768, top-4, sigmoid
# scores, DeepSeek-V3's expert bias) on 8 GPU(s): dmoe_fine_125m_1gpu.sh's model at MegaBlocks'
# 8-GPU recipe (global batch 512 x 1024 tokens, micro batch 64), as dmoe_125m_8gpu.sh runs the
# MegaBlocks dMoE-125M.
# Usage: examples/dmoe_fine_125m_8gpu.sh [DATA_PATH [VOCAB_FILE [MERGE_FILE [OUTPUT_DIR]]]] [pretrain_gpt.py flags...]
# (details in examples/common.sh, docs/examples.md and docs/moe.md)
set -euo pipefail

NPROC_PER_NODE=${NPROC_PER_NODE:-8}
MODEL_ARGS=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --init-method-std 0.01
    --moe-num-experts 256 --moe-ffn-hidden-size 768 --moe-top-k 4 --moe-router-score sigmoid
    --moe-router-bias-update-rate 0.001 --moe-loss-weight 0.1 --moe-impl grouped)
BATCH_ARGS=(--micro-batch-size 64 --lr 0.0006 --min-lr 0.00006)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
launch_pretraining dmoe_fine_125m_8gpu "$@"
