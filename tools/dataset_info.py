"""Summarize the GPT training samples Megatron would build from a dataset, and show the first one.

    python tools/dataset_info.py --data-path PREFIX --split 949,50,1 --seq-length 1024 \\
        --train-samples 1000 --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt

The library is megatron.data.dataset_info.
"""

import sys

from megatron.data.dataset_info import main

if __name__ == "__main__":
    sys.exit(main())
