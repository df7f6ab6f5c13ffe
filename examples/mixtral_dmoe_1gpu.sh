#!/usr/bin/env bash
# A Mixtral-shaped dMoE on 1 GPU: Mixtral-8x7B's layer (hidden 4096, 32 heads in 8 query
# groups, RoPE, RMSNorm, no biases; 8 SwiGLU experts of FFN 14336, top-2) with only as many
# layers as one GPU holds with Adam state: the shape at which FP8 (--fp8-format) is measured.
# Usage: examples/mixtral_dmoe_1gpu.sh [DATA_PATH [VOCAB_FILE [MERGE_FILE [OUTPUT_DIR]]]] [pretrain_gpt.py flags...]
# (details in examples/common.sh and docs/examples.md)
set -euo pipefail

NPROC_PER_NODE=${NPROC_PER_NODE:-1}
MODEL_ARGS=(--num-layers 3 --hidden-size 4096 --num-attention-heads 32 --num-query-groups 8
    --ffn-hidden-size 14336 --swiglu --normalization RMSNorm --position-embedding-type rope
    --disable-bias-linear --untie-embeddings-and-output-weights --init-method-std 0.01
    --moe-num-experts 8 --moe-top-k 2 --mlp-type glu --moe-loss-weight 0.01 --moe-impl grouped)
BATCH_ARGS=(--lr 0.0003 --min-lr 0.00003)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
moe_memory_choices 8
launch_pretraining mixtral_dmoe_1gpu "$@"
