#!/usr/bin/env bash
# Fine-grained dMoE 125m (12 layers, hidden 768, 12 heads, 256 experts of ffn 768, top-4) on 1 GPU:
# the dMoE-125M's active FLOPs and total expert weights (dmoe_125m_1gpu.sh: 64 experts of ffn 3072,
# top-1) cut into experts a quarter the size, with sigmoid router scores and DeepSeek-V3's expert
# bias for balance beside the load-balancing loss at 0.1. Of the routings measured on real text
# it reaches the dense GPT-2 125M's loss with the fewest tokens (docs/moe.md, "Which routing to
# use"). The memory settings are chosen as in dmoe_125m_1gpu.sh (same weights, same
# activations): micro batch 64 with fp32 optimizer state on a 141 GB H200, micro batch 32 with
# bf16 gradients and Adam moments on an 80 GB H100. On Hopper with quack-kernels installed, add
# --moe-grouped-gemm-kernel quack (faster grouped products at this shape: docs/moe.md).
# Usage: examples/dmoe_fine_125m_1gpu.sh [DATA_PATH [VOCAB_FILE [MERGE_FILE [OUTPUT_DIR]]]] [pretrain_gpt.py flags...]
# (details in examples/common.sh, docs/examples.md and docs/moe.md)
set -euo pipefail

NPROC_PER_NODE=${NPROC_PER_NODE:-1}
MODEL_ARGS=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --init-method-std 0.01
    --moe-num-experts 256 --moe-ffn-hidden-size 768 --moe-top-k 4 --moe-router-score sigmoid
    --moe-router-bias-update-rate 0.001 --moe-loss-weight 0.1 --moe-impl grouped)
BATCH_ARGS=(--lr 0.0006 --min-lr 0.00006)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
moe_memory_choices 64 offload
launch_pretraining dmoe_fine_125m_1gpu "$@"
