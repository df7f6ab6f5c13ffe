"""Generate text from a checkpoint of pretrain_gpt.py (any format, any parallel layout).

    python tools/generate.py --load runs/quickstart/checkpoints --prompt "The city of" \\
        --tokens-to-generate 32 --greedy
    python tools/generate.py --load CKPT --prompts-file prompts.txt --top-p 0.9 --seed 7

Prints each prompt followed by its completion (--json: one JSON object per line instead);
progress goes to stderr. The model runs on the GPU when there is one, in bf16 (the model is
cast; no autocast), else on the CPU in fp32 (--device, --dtype). Sampling is at temperature
1 over the whole vocabulary unless --greedy, --top-k, --top-p or --temperature say otherwise,
and a completion stops at the end-of-document token or after --tokens-to-generate tokens.
The tokenizer is the checkpoint's (its saved --tokenizer-type and files); --vocab-file,
--merge-file and --tokenizer-model replace files saved as paths of another machine.
The library is gpt_pretraining.generate_text.
"""

import sys

from gpt_pretraining.generate_text import main

if __name__ == "__main__":
    sys.exit(main())
