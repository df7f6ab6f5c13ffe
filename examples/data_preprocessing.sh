#!/usr/bin/env bash
# Tokenize a JSON-lines corpus into Megatron's indexed dataset, as Megatron-LM's README does for
# OSCAR (oscar-1GB.jsonl, https://huggingface.co/bigscience/misc-test-data). Nothing is
# downloaded: pass the corpus and the GPT-2 vocabulary you already have.
#
# Usage: examples/data_preprocessing.sh [INPUT [OUTPUT_PREFIX [VOCAB_FILE [MERGE_FILE]]]]
#   INPUT          .jsonl / .jsonl.xz / .jsonl.gz file or quoted glob
#                  (default: the bundled sample data/sample/openwebtext-1000.jsonl.xz)
#   OUTPUT_PREFIX  writes OUTPUT_PREFIX_text_document.{bin,idx} (default data/owt/owt)
#   VOCAB_FILE     GPT-2 vocab.json (default data/sample/gpt2-vocab.json)
#   MERGE_FILE     GPT-2 merges.txt (default data/sample/gpt2-merges.txt)
# Each argument falls back to the environment variable INPUT, OUTPUT_PREFIX, VOCAB_FILE,
# MERGE_FILE; WORKERS defaults to $(nproc).
#
# e.g. examples/data_preprocessing.sh oscar-1GB.jsonl.xz data/oscar/meg-gpt2
#      examples/gpt2_125m_8gpu.sh data/oscar/meg-gpt2_text_document
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
INPUT=${1:-${INPUT:-$REPO_ROOT/data/sample/openwebtext-1000.jsonl.xz}}
OUTPUT_PREFIX=${2:-${OUTPUT_PREFIX:-$REPO_ROOT/data/owt/owt}}
VOCAB_FILE=${3:-${VOCAB_FILE:-$REPO_ROOT/data/sample/gpt2-vocab.json}}
MERGE_FILE=${4:-${MERGE_FILE:-$REPO_ROOT/data/sample/gpt2-merges.txt}}
WORKERS=${WORKERS:-$(nproc)}

mkdir -p "$(dirname "$OUTPUT_PREFIX")"
# PYTHONPATH: the tool imports this checkout's package, installed or not.
PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" python "$REPO_ROOT/tools/preprocess_data.py" \
    --input "$INPUT" \
    --output-prefix "$OUTPUT_PREFIX" \
    --vocab-file "$VOCAB_FILE" \
    --merge-file "$MERGE_FILE" \
    --tokenizer-type GPT2BPETokenizer \
    --dataset-impl mmap \
    --append-eod \
    --workers "$WORKERS"
echo "train on it with e.g.: examples/gpt2_125m_1gpu.sh ${OUTPUT_PREFIX}_text_document" >&2
