#!/usr/bin/env bash
# dMoE (dropless MoE) 125m (12 layers, hidden 768, 12 heads, 64 experts of ffn 3072, top-1) on 1 GPU,
# MegaBlocks' recipe: global batch 512 x 1024 tokens, load-balancing loss weight 0.1. On one GPU
# each micro-batch streams all 3.6 billion expert weights and adds their gradients, so fewer,
# larger micro-batches are faster; the state (fp32 weights, gradients, Adam's moments: 59 GB) is
# what limits them. The memory settings are chosen for the GPU at hand (MEMORY_CHOICES, fastest
# first; tools/estimate_memory.py --choose, the first line printed says which and why):
#   - micro batch 64 with fp32 optimizer state where it fits (a 141 GB H200: about 107 GiB);
#   - micro batch 32 with bf16 gradients and Adam moments (--use-precision-aware-optimizer, the
#     update still in fp32) on an 80 GB H100 (about 67 GiB);
#   - smaller GPUs: full recomputation, then micro batch 16, then the optimizer state on the host.
# Measured speeds against the dense GPT-2 125M: BENCHMARKS.md, "dMoE training".
# Usage: examples/dmoe_125m_1gpu.sh [DATA_PATH [VOCAB_FILE [MERGE_FILE [OUTPUT_DIR]]]] [pretrain_gpt.py flags...]
# (details in examples/common.sh, docs/examples.md and docs/moe.md)
set -euo pipefail

NPROC_PER_NODE=${NPROC_PER_NODE:-1}
MODEL_ARGS=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --init-method-std 0.01
    --moe-num-experts 64 --moe-top-k 1 --moe-loss-weight 0.1 --moe-impl grouped)
BATCH_ARGS=(--lr 0.0006 --min-lr 0.00006)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
moe_memory_choices 64 offload
launch_pretraining dmoe_125m_1gpu "$@"
