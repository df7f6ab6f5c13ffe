#!/usr/bin/env bash
# Set up a fresh machine and run the main job on the bundled sample corpus.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
out=runs/quickstart
mkdir -p "$out/data"
python tools/preprocess_data.py \
    --input data/sample/openwebtext-1000.jsonl.xz \
    --output-prefix "$out/data/owt" \
    --vocab-file data/sample/gpt2-vocab.json --merge-file data/sample/gpt2-merges.txt \
    --tokenizer-type GPT2BPETokenizer --append-eod --workers "$(python -c 'import os; print(min(os.cpu_count(), 16))')" \
    --log-interval 250
python tools/dataset_info.py \
    --data-path "$out/data/owt_text_document" --split 949,50,1 --seq-length 1024 \
    --train-samples 800 --valid-samples 40 --test-samples 8 \
    --vocab-file data/sample/gpt2-vocab.json --merge-file data/sample/gpt2-merges.txt
