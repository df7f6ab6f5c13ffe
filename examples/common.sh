# Shared launch plumbing for the examples/gpt2_*.sh scripts; sourced, not run.
#
# A size script sets MODEL_ARGS (layers, hidden size, heads, init std), BATCH_ARGS (micro batch,
# learning rates) and NPROC_PER_NODE's default, then calls `launch_pretraining NAME "$@"`. It may
# set MEMORY_CHOICES, flag sets fastest first: the memory planner (tools/estimate_memory.py
# --choose) takes the first whose run fits this machine's GPU, and the first line printed says
# which and why (without MEMORY_CHOICES it checks the script's own settings the same way). The
# one-GPU MoE scripts source this file first and set theirs with `moe_memory_choices`.
#
# Positional arguments, each falling back to the environment variable of the same name:
#   1 DATA_PATH   indexed-dataset prefix, or a blend "W1 PREFIX1 W2 PREFIX2 ..."
#                 (default data/owt/owt_text_document, written by examples/data_preprocessing.sh)
#   2 VOCAB_FILE  GPT-2 vocab.json  (default data/sample/gpt2-vocab.json)
#   3 MERGE_FILE  GPT-2 merges.txt  (default data/sample/gpt2-merges.txt)
#   4 OUTPUT_DIR  checkpoints/, tensorboard/ and train.log (default runs/NAME); re-running resumes
# The first argument starting with "-" (or a literal "--") ends the positional ones; it and all
# later arguments, then the words of EXTRA_ARGS, are appended to pretrain_gpt.py's flags, so
# they override the script's values (argparse keeps the last one).
#
# Other environment variables: NPROC_PER_NODE, NNODES (1), NODE_RANK (0), MASTER_ADDR
# (localhost), MASTER_PORT (6000) for torchrun; PRECISION (bf16, fp16 or fp32); GPU_MEMORY_GIB
# (the GPU memory the memory settings are chosen for; default: this machine's first GPU, or 80
# without one); DRY_RUN=1 prints the command instead of running it.

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# Flags every GPT-2 example shares: MegaBlocks' training recipe at sequence length 1024.
# --lr-decay-iters is left to default to --train-iters, so overriding --train-iters keeps a
# complete cosine schedule (MegaBlocks passes the same value for both).
SHARED_ARGS=(
    --seq-length 1024
    --max-position-embeddings 1024
    --global-batch-size 512
    --train-iters 100000
    --lr-decay-style cosine
    --lr-warmup-fraction 0.01
    --clip-grad 1.0
    --split 969,30,1
    --make-vocab-size-divisible-by 1024
    --tokenizer-type GPT2BPETokenizer
    --log-interval 100
    --eval-interval 1000
    --eval-iters 100
    --save-interval 2000
)

# MEMORY_CHOICES of a one-GPU MoE script, whose expert state is what limits it, from micro batch
# MB down: fp32 optimizer state; bf16 gradients and Adam moments (--use-precision-aware-optimizer,
# the update still in fp32); half the micro batch; full recomputation; a quarter of it; with
# `offload`, the optimizer state on the host last. Arguments: MB [offload].
moe_memory_choices() {
    local micro_batch=$1 offload=${2:-}
    local bf16_state="--use-precision-aware-optimizer --main-grads-dtype bf16 --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16"
    local recompute="--recompute-granularity full --recompute-method uniform"
    local half=$((micro_batch / 2)) quarter=$((micro_batch / 4))
    MEMORY_CHOICES=(
        "--micro-batch-size $micro_batch"
        "--micro-batch-size $micro_batch $bf16_state"
        "--micro-batch-size $half $bf16_state"
        "--micro-batch-size $half $bf16_state $recompute"
        "--micro-batch-size $quarter $bf16_state $recompute"
    )
    [[ -z $offload ]] || MEMORY_CHOICES+=("--micro-batch-size $quarter $bf16_state $recompute --optimizer-cpu-offload")
}

die() {
    echo "error: $*" >&2
    exit 1
}

# Fail early, with the fix, when a dataset prefix has no .idx file. Arguments: DATA_PATH's words.
check_data_path() {
    local word
    for word in "$@"; do
        # Blend weights are numbers; everything else is a dataset prefix.
        [[ $word =~ ^[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?$ ]] && continue
        if [[ ! -f "$word.idx" ]]; then
            local message="dataset index $word.idx not found (DATA_PATH=\"$DATA_PATH\"); run examples/data_preprocessing.sh to create data/owt/owt_text_document from the bundled sample, or pass your own prefix as the first argument"
            [[ ${DRY_RUN:-0} == 1 ]] || die "$message"
            echo "warning: $message" >&2
        fi
    done
}

precision_args() {
    case ${PRECISION:-bf16} in
        bf16) echo --bf16 ;;
        fp16) echo --fp16 ;;
        fp32) ;;
        *) die "PRECISION=${PRECISION} is not one of bf16, fp16, fp32" ;;
    esac
}

launch_pretraining() {
    local name=$1
    shift
    local positional=()
    while (($# > 0)) && ((${#positional[@]} < 4)) && [[ $1 != -* ]]; do
        positional+=("$1")
        shift
    done
    [[ ${1:-} == -- ]] && shift
    (($# == 0)) || [[ $1 == -* ]] || die "unexpected argument '$1': at most 4 positional arguments (DATA_PATH VOCAB_FILE MERGE_FILE OUTPUT_DIR) come before the extra flags"

    DATA_PATH=${positional[0]:-${DATA_PATH:-$REPO_ROOT/data/owt/owt_text_document}}
    VOCAB_FILE=${positional[1]:-${VOCAB_FILE:-$REPO_ROOT/data/sample/gpt2-vocab.json}}
    MERGE_FILE=${positional[2]:-${MERGE_FILE:-$REPO_ROOT/data/sample/gpt2-merges.txt}}
    OUTPUT_DIR=${positional[3]:-${OUTPUT_DIR:-$REPO_ROOT/runs/$name}}

    local data_words extra_words precision
    read -ra data_words <<<"$DATA_PATH"
    read -ra extra_words <<<"${EXTRA_ARGS:-}"
    precision=$(precision_args)
    ((${#data_words[@]} > 0)) || die "DATA_PATH is empty"
    check_data_path "${data_words[@]}"
    [[ -f $VOCAB_FILE ]] || die "vocab file $VOCAB_FILE not found (VOCAB_FILE, second argument)"
    [[ -f $MERGE_FILE ]] || die "merge file $MERGE_FILE not found (MERGE_FILE, third argument)"

    # The memory settings: the first of MEMORY_CHOICES the planner fits in the GPU, placed before
    # the user's own flags so that those still win.
    local base_args=(
        "${MODEL_ARGS[@]}" "${BATCH_ARGS[@]}" "${SHARED_ARGS[@]}" $precision
        --data-path "${data_words[@]}" --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"
        --save "$OUTPUT_DIR/checkpoints" --load "$OUTPUT_DIR/checkpoints"
        --tensorboard-dir "$OUTPUT_DIR/tensorboard"
    )
    local choice_args=() choice
    for choice in "${MEMORY_CHOICES[@]-}"; do
        choice_args+=("--choose=$choice")
    done
    local chosen reason_file
    reason_file=$(mktemp)
    # PYTHONPATH: the tool imports this checkout's package, installed or not.
    chosen=$(PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" \
        python "$REPO_ROOT/tools/estimate_memory.py" \
        --world-size $((${NPROC_PER_NODE:-1} * ${NNODES:-1})) \
        --gpu-memory-gib "${GPU_MEMORY_GIB:-auto}" "${choice_args[@]}" \
        "${base_args[@]}" --then "$@" "${extra_words[@]}" 2>"$reason_file") || {
        cat "$reason_file" >&2
        rm -f "$reason_file"
        die "the memory planner (tools/estimate_memory.py) could not read these flags"
    }
    local reason
    reason=$(<"$reason_file")
    rm -f "$reason_file"
    local memory_words
    read -ra memory_words <<<"$chosen"

    local command=(
        torchrun
        --nproc_per_node "${NPROC_PER_NODE:-1}"
        --nnodes "${NNODES:-1}"
        --node_rank "${NODE_RANK:-0}"
        --master_addr "${MASTER_ADDR:-localhost}"
        --master_port "${MASTER_PORT:-6000}"
        "$REPO_ROOT/pretrain_gpt.py"
        "${base_args[@]}"
        "${memory_words[@]}"
        "$@"
        "${extra_words[@]}"
    )

    if [[ ${DRY_RUN:-0} == 1 ]]; then
        echo "$reason"
        printf '%q ' "${command[@]}"
        echo
        return 0
    fi
    mkdir -p "$OUTPUT_DIR"
    { echo "$name: $reason"; "${command[@]}" 2>&1; } | tee -a "$OUTPUT_DIR/train.log"
}
