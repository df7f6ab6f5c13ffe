"""Estimate a pretrain_gpt.py run's peak GPU memory per rank, without a GPU or data.

    python tools/estimate_memory.py --world-size 8 --gpu-memory-gib 80 \\
        --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 \\
        --max-position-embeddings 1024 --micro-batch-size 32 --global-batch-size 512 \\
        --bf16 --moe-num-experts 64 --moe-top-k 1

Takes pretrain_gpt.py's flags (MoE flags included; `@FILE` too; --lr and --train-iters are not
needed, a step's memory does not depend on them) plus `--world-size` (default 1) and
`--gpu-memory-gib` (default 80; `auto`: this machine's first GPU, or 80 without one); prints the
start-up line pretrain_gpt.py prints, a table of the parts (megatron.memory_plan), and when the
run does not fit, the flags that would make it fit.

With `--choose FLAGS` (repeated, fastest first) it picks instead: it prints on stdout the first
FLAGS whose run fits the GPU (or the last, with a warning, when none does) and on stderr one
line saying what it chose and why. Flags after a final `--then` are applied after the choice
(a user's own flags, which override it). The example scripts choose their memory settings this way
(examples/common.sh).
The data files are never read: without a data source the tool passes a placeholder
--data-path, and without --vocab-file/--merge-file the bundled GPT-2 vocabulary (only its size
matters); it says so. Bad flags: one `error:` line, exit 1. The library is
megatron.memory_plan.command_line, given the run pretrain_gpt.py trains (gpt_pretraining.GPT_RUN)
by gpt_pretraining.estimate_memory.
"""

import sys

from gpt_pretraining.estimate_memory import main

if __name__ == "__main__":
    sys.exit(main())
