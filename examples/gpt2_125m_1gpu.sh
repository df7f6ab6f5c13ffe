#!/usr/bin/env bash
# GPT-2 125M (12 layers, hidden 768, 12 heads) on 1 GPU, MegaBlocks' hyper-parameters:
# global batch 512 x 1024 tokens, 100k iterations. The micro batch is the fastest that fits the
# GPU at hand (MEMORY_CHOICES, fastest first; tools/estimate_memory.py --choose, the first line
# printed says which and why): 64 where it fits (4% faster per iteration than 32 on an H200,
# about 38 GiB), else 32, 16, 8. The dMoE examples choose the same way, so the two are compared
# at their own best settings.
# Usage: examples/gpt2_125m_1gpu.sh [DATA_PATH [VOCAB_FILE [MERGE_FILE [OUTPUT_DIR]]]] [pretrain_gpt.py flags...]
# (details in examples/common.sh and docs/examples.md)
set -euo pipefail

NPROC_PER_NODE=${NPROC_PER_NODE:-1}
MODEL_ARGS=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --init-method-std 0.01)
# Same recipe as the 8-GPU script (same global batch), with more gradient accumulation.
BATCH_ARGS=(--lr 0.0006 --min-lr 0.00006)
MEMORY_CHOICES=(
    "--micro-batch-size 64"
    "--micro-batch-size 32"
    "--micro-batch-size 16"
    "--micro-batch-size 8"
)

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
launch_pretraining gpt2_125m_1gpu "$@"
