#!/usr/bin/env bash
# dMoE (dropless MoE) 125m (12 layers, hidden 768, 12 heads, 64 experts of ffn 3072, top-1) on 1 GPU(s),
# MegaBlocks' recipe: global batch 512 x 1024 tokens, load-balancing loss weight 0.1; micro batch 64
# (MegaBlocks runs 8 per GPU on 8 GPUs): on one GPU each micro-batch streams all 3.6 billion expert
# weights and adds their gradients into fp32, so fewer, larger micro-batches are faster.
# Memory: 108 GB peak at micro batch 64 (H200, 141 GB). On an 80 GB GPU (H100) run
#   PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True examples/dmoe_125m_1gpu.sh ... \
#       --micro-batch-size 32 --recompute-granularity full --recompute-method uniform
# (measured on an H100: 2.2-2.4 s per iteration, 0.48x the dense GPT-2 125M; 76.2 GiB peak of
# 79.2; without expandable segments one run in four ran out of memory to fragmentation), or,
# with room to spare but slower, --micro-batch-size 8 --no-gradient-accumulation-fusion
# (4.1 s per iteration, 69 GiB peak; no bf16 expert weight copies).
# Usage: examples/dmoe_125m_1gpu.sh [DATA_PATH [VOCAB_FILE [MERGE_FILE [OUTPUT_DIR]]]] [pretrain_gpt.py flags...]
# (details in examples/common.sh, docs/examples.md and docs/moe.md)
set -euo pipefail

NPROC_PER_NODE=${NPROC_PER_NODE:-1}
MODEL_ARGS=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --init-method-std 0.01
    --moe-num-experts 64 --moe-top-k 1 --moe-loss-weight 0.1 --moe-impl grouped)
BATCH_ARGS=(--micro-batch-size 64 --lr 0.0006 --min-lr 0.00006)

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
launch_pretraining dmoe_125m_1gpu "$@"
