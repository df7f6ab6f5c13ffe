"""Loss and perplexity of a checkpoint on an indexed dataset, without training.

    python tools/evaluate.py --load checkpoints --data-path my-gpt2_text_document \\
        [--split 969,30,1 --split-name valid | --whole-dataset] [--eval-iters N] [--bf16]

Prints Megatron's validation line for the samples training cuts from the dataset. What it reads,
in what order, and how it averages: gpt_pretraining/evaluation.py, its library.
"""

import sys

from gpt_pretraining.evaluation import main

if __name__ == "__main__":
    sys.exit(main())
