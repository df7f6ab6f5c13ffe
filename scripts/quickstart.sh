#!/usr/bin/env bash
# Set up a fresh machine and run the main job on the bundled sample corpus:
# preprocess 1,000 OpenWebText documents, train a small dMoE GPT (every MLP a dropless MoE of 8
# experts, top-2, with MegaBlocks' flags) for 100 iterations, stop and save, resume from that
# checkpoint for 100 more, print validation and test perplexity, let the trained model
# continue a short prompt (greedy and sampled), and plot its loss curves.
# Runs on the CPU in a few minutes, or on a GPU when torch sees one.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh plot  # matplotlib, for tools/plot_runs.py
out=runs/quickstart
rm -rf "$out"
mkdir -p "$out/data"

echo "== 1/5 preprocessing the bundled corpus"
python tools/preprocess_data.py \
    --input data/sample/openwebtext-1000.jsonl.xz \
    --output-prefix "$out/data/owt" \
    --vocab-file data/sample/gpt2-vocab.json --merge-file data/sample/gpt2-merges.txt \
    --tokenizer-type GPT2BPETokenizer --append-eod \
    --workers "$(python -c 'import os; print(min(os.cpu_count() or 1, 16))')" --log-interval 250

precision=()
if python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    precision=(--bf16)
fi
train() {
    python pretrain_gpt.py \
        --num-layers 4 --hidden-size 128 --num-attention-heads 4 \
        --seq-length 128 --max-position-embeddings 128 \
        --micro-batch-size 4 --global-batch-size 8 --train-iters 200 \
        --lr 0.002 --min-lr 0.0002 --lr-decay-style cosine --lr-warmup-iters 10 \
        --clip-grad 1.0 --weight-decay 0.01 --init-method-std 0.02 \
        --moe-num-experts 8 --moe-top-k 2 --moe-loss-weight 0.1 \
        --data-path "$out/data/owt_text_document" --split 949,50,1 \
        --vocab-file data/sample/gpt2-vocab.json --merge-file data/sample/gpt2-merges.txt \
        --log-interval 20 --eval-interval 100 --eval-iters 10 --num-workers 1 \
        --save "$out/checkpoints" --load "$out/checkpoints" --save-interval 100 \
        --tensorboard-dir "$out/tensorboard" "${precision[@]}" "$@" 2>&1 |
        grep -v -E '^  [a-zA-Z0-9_]+ \.+ ' # the long arguments block stays in the checkpoint's args
}

echo "== 2/5 training iterations 1-100, then stopping with a checkpoint (--exit-interval 100)"
train --exit-interval 100
echo "== 3/5 resuming from $(cat "$out/checkpoints/latest_checkpointed_iteration.txt") and training to 200"
train
echo "== 4/5 the trained model continues a prompt (tools/generate.py, 32 tokens): greedy, then sampled"
python tools/generate.py --load "$out/checkpoints" --prompt "The history of the city" \
    --tokens-to-generate 32 --greedy
python tools/generate.py --load "$out/checkpoints" --prompt "The history of the city" \
    --tokens-to-generate 32 --temperature 0.8 --top-p 0.9 --seed 1
echo "== 5/5 its training and validation loss (tools/plot_runs.py)"
python tools/plot_runs.py "$out" --output "$out/loss.png"
echo "== done: checkpoints in $out/checkpoints, TensorBoard logs in $out/tensorboard, the plot in $out/loss.png"
