#!/usr/bin/env bash
# torchtitan 0.2.2 throughput of a GPT-2-125M-shaped MoE (12 x 768, 12 heads, 64 experts,
# top-1, seq 1024, global batch 512) on one node of NGPU GPUs (4 by default), at the layouts
# named epN (expert-parallel degree N; every weight FSDP-sharded over all NGPU ranks):
#   ep4: expert parallel 4; dense weights FSDP over the same 4 ranks (DP 4)
#   ep1: no expert parallelism; every weight, experts included, FSDP over 4 ranks
# Prints torchtitan's log lines with tps (tokens/s per GPU) and the steady-state mean.
#
# Issue 38's peer comparison (acceptance 8); checked on CPU at a tiny shape, not yet on GPUs.
# Its model is torchtitan's Qwen3-MoE family at this shape (tt_moe_bench.py says how it
# differs from the dMoE: SwiGLU experts of ffn 2048, RMSNorm, RoPE, expert-bias balancing).
#
# usage: run_torchtitan_moe.sh WHEEL_DIR [epN...]      (default: ep4 ep1)
#        WHEEL_DIR from download_wheels.sh, e.g. on the device machine with .tt carried:
#        bash bench/torchtitan/run_torchtitan_moe.sh .tt/wheels ep4
# env:   TT_FLAVOR  moe125m (default; SwiGLU experts of ffn 2048 = the parameters and FLOPs of
#                   GELU experts of ffn 3072) | moe125m_ffn3072 (SwiGLU ffn 3072)
#        TT_STEPS (60), TT_LBS (64: local batch; TT_GBS 512 global -> grad accumulation 2),
#        NGPU (4), PYTHON (python3), TT_WORK (/tmp/tt_run), GPT2_DIR, OWT_XZ,
#        TT_EXTRA (extra torchtitan CLI flags, e.g. "--compile.no-enable")
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
WHEELS=$(cd "${1:?usage: run_torchtitan_moe.sh WHEEL_DIR [ep4] [ep1]}" && pwd)
shift
SETTINGS=${*:-ep4 ep1}
PY=${PYTHON:-python3}
NGPU=${NGPU:-4}
WORK=${TT_WORK:-/tmp/tt_run}
FLAVOR=${TT_FLAVOR:-moe125m}
STEPS=${TT_STEPS:-60}
LBS=${TT_LBS:-64}
GBS=${TT_GBS:-512}
# TT_ENTRY: what torchrun starts (CPU tests use "cpu_smoke.py"; default torchtitan.train)
read -r -a ENTRY <<< "${TT_ENTRY:--m torchtitan.train}"
mkdir -p "$WORK"

# 1. Packages torchtitan 0.2.2 needs that the image lacks, into a private folder
#    (torch, triton, numpy, pyarrow, pandas, tokenizers, huggingface_hub, tensorboard... come
#    from the image). --no-deps: the wheel folder holds the complete set.
"$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-deps --no-compile \
    --no-cache-dir --upgrade --target "$WORK/site" \
    torchtitan==0.2.2 torchdata==0.11.0 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18 \
    tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 fsspec==2026.2.0
export PYTHONPATH="$WORK/site:$HERE${PYTHONPATH:+:$PYTHONPATH}"

# Nothing may be downloaded; keep NVLink multicast off (the device's rule).
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_DATASETS_CACHE="$WORK/hf_datasets"
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCHINDUCTOR_CACHE_DIR="$WORK/inductor_cache"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

"$PY" -c "import torch, torchtitan; print('torch', torch.__version__, '| torchtitan', \
torchtitan.__version__, torchtitan.__file__, '| GPUs', torch.cuda.device_count())"

# 2. Local tokenizer (tokenizer.json built from GPT-2 vocab/merges) and dataset (jsonl).
find_first() { for p in "$@"; do [ -e "$p" ] && { echo "$p"; return; }; done; return 1; }
GPT2_DIR=${GPT2_DIR:-$(dirname "$(find_first ./data/sample/gpt2-vocab.json \
    /work/main/data/sample/gpt2-vocab.json /work/shared/data/gpt2/gpt2-vocab.json \
    ../shared/data/gpt2/gpt2-vocab.json ./shared/data/gpt2/gpt2-vocab.json)")}
OWT_XZ=${OWT_XZ:-$(find_first ./data/sample/openwebtext-1000.jsonl.xz \
    /work/main/data/sample/openwebtext-1000.jsonl.xz \
    /work/shared/data/owt/openwebtext-1000.jsonl.xz \
    ../shared/data/owt/openwebtext-1000.jsonl.xz ./shared/data/owt/openwebtext-1000.jsonl.xz)}
"$PY" "$HERE/prepare_assets.py" "$GPT2_DIR" "$OWT_XZ" "$WORK/assets"

# 3. Train each layout; rank 0's log is shown and kept in $WORK/log_<setting>.txt (all ranks' logs
#    under $WORK/torchrun_logs_<setting>/).
summary=()
for s in $SETTINGS; do
    case $s in
        ep[1-9]*) PAR=(--parallelism.expert_parallel_degree "${s#ep}"
                       --parallelism.data_parallel_shard_degree "$NGPU") ;;
        *) echo "unknown setting $s (epN: expert-parallel degree N, e.g. ep4 or ep1)"; exit 2 ;;
    esac
    echo "=== torchtitan $FLAVOR $s: ${PAR[*]} ==="
    set +e
    # shellcheck disable=SC2086
    "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NGPU" \
        --local-ranks-filter 0 --role rank --tee 3 --log-dir "$WORK/torchrun_logs_$s" \
        "${ENTRY[@]}" \
        --job.config_file "$HERE/moe125m.toml" \
        --job.dump_folder "$WORK/out_$s" \
        --model.flavor "$FLAVOR" \
        --model.hf_assets_path "$WORK/assets/tokenizer" \
        --training.dataset_path "$WORK/assets/data" \
        --training.steps "$STEPS" --training.local_batch_size "$LBS" \
        --training.global_batch_size "$GBS" --metrics.log_freq 10 \
        "${PAR[@]}" ${TT_EXTRA:-} 2>&1 | tee "$WORK/log_$s.txt"
    rc=${PIPESTATUS[0]}
    set -e
    line=$("$PY" - "$WORK/log_$s.txt" "$s" "$rc" <<'EOF'
import re, sys
path, name, rc = sys.argv[1:]
pts = []
for l in open(path, errors="replace"):
    m = re.search(r"step:\s*(\d+)\s.*tps:\s*([\d,]+)", l)
    if m:
        pts.append((int(m.group(1)), int(m.group(2).replace(",", ""))))
# each logged tps covers the window since the previous log; drop step 1 (compile) and
# the windows up to step 20 (re-compiles, lr warm-up, allocator growth)
steady = [(s, t) for s, t in pts if s >= 30] or pts[2:]
mean = sum(t for _, t in steady) / len(steady) if steady else float("nan")
span = f"windows ending at steps {[s for s, _ in steady]}"
print(f"{name}: rc {rc}; tps per GPU by logged step {pts}; "
      f"steady-state mean over {span}: {mean:,.0f} tokens/s/GPU")
EOF
)
    echo "$line"
    summary+=("$line")
done
echo "=== summary (torchtitan 0.2.2, $FLAVOR, tps = rank 0's tokens/s = per GPU) ==="
printf '%s\n' "${summary[@]}"
