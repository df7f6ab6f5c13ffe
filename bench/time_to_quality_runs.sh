#!/usr/bin/env bash
# Dense against dMoE (and the MoE with capacity) on the same tokens, for tools/time_to_quality.py:
# each named example script on one GPU at global batch 256 for 381 iterations (99.9M tokens,
# a whole cosine decay), validation every 50 iterations on 10 batches, no checkpoints.
#
# Usage: bench/time_to_quality_runs.sh DATA_PREFIX VOCAB_FILE MERGE_FILE OUT_ROOT EXAMPLE...
#   EXAMPLE  an examples/ script's name without .sh, e.g. gpt2_125m_1gpu dmoe_125m_1gpu
#            moe_125m_8gpu (run one after another, each into OUT_ROOT/EXAMPLE)
# Environment: TRAIN_ITERS (381), EXTRA_ARGS (more pretrain_gpt.py flags, as common.sh reads them).
# Then: python tools/time_to_quality.py OUT_ROOT/gpt2_125m_1gpu OUT_ROOT/dmoe_125m_1gpu ...
#
# A run that must stop before its end (a machine held for a limited time) can be made in pieces:
# add --save DIR --load DIR --exit-duration-in-mins N to EXTRA_ARGS and run the same command again; the tool
# counts the training time of the pieces without the gaps. BENCHMARKS.md, "Time to quality",
# has the Gutenberg dataset's numbers and how the data reaches a GPU machine.
set -euo pipefail

(($# >= 5)) || {
    sed -n '2,10p' "$0" >&2
    exit 2
}
data_prefix=$1 vocab_file=$2 merge_file=$3 out_root=$4
shift 4
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
for example in "$@"; do
    [[ -f $repo_root/examples/$example.sh ]] || {
        echo "error: no examples/$example.sh (EXAMPLE names a script of examples/ without .sh)" >&2
        exit 2
    }
done
for example in "$@"; do
    echo "== $example -> $out_root/$example"
    NPROC_PER_NODE=1 bash "$repo_root/examples/$example.sh" \
        "$data_prefix" "$vocab_file" "$merge_file" "$out_root/$example" \
        --global-batch-size 256 --train-iters "${TRAIN_ITERS:-381}" \
        --eval-interval 50 --eval-iters 10 --log-interval 10 --save "" --load ""
done
