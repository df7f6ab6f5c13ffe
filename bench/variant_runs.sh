#!/usr/bin/env bash
# One example script under several flag sets on the same tokens, for tools/time_to_quality.py:
# each variant is bench/time_to_quality_runs.sh's run of EXAMPLE (same data order, seed and
# schedule) with its own flags added, into OUT_ROOT/LABEL/EXAMPLE.
#
# Usage: bench/variant_runs.sh DATA_PREFIX VOCAB_FILE MERGE_FILE OUT_ROOT EXAMPLE LABEL=FLAGS...
#   LABEL=FLAGS  the variant's name and the pretrain_gpt.py flags it adds ("base=": none)
# Environment: TRAIN_ITERS and EXTRA_ARGS as time_to_quality_runs.sh reads them; STOP_AT=N ends
# every run after iteration N of the whole schedule (--exit-interval N): the start of the curves
# at the learning rates of the full run.
# Then: python tools/time_to_quality.py OUT_ROOT/base/EXAMPLE OUT_ROOT/LABEL/EXAMPLE ...
set -euo pipefail

(($# >= 6)) || {
    sed -n '2,11p' "$0" >&2
    exit 2
}
data_prefix=$1 vocab_file=$2 merge_file=$3 out_root=$4 example=$5
shift 5
for variant in "$@"; do
    [[ $variant == *=* && ${variant%%=*} =~ ^[A-Za-z0-9._-]+$ ]] || {
        echo "error: variant '$variant' is not LABEL=FLAGS (LABEL in letters, digits, '.', '_', '-')" >&2
        exit 2
    }
done
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
stop=${STOP_AT:+--exit-interval $STOP_AT}
for variant in "$@"; do
    label=${variant%%=*} flags=${variant#*=}
    echo "== $example [$label: ${flags:-no flags}] -> $out_root/$label/$example"
    EXTRA_ARGS="${EXTRA_ARGS:-} $stop $flags" bash "$repo_root/bench/time_to_quality_runs.sh" \
        "$data_prefix" "$vocab_file" "$merge_file" "$out_root/$label" "$example"
done
