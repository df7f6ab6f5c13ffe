"""Turn a JSON-lines corpus into Megatron's mmap indexed dataset (`PREFIX_{key}_document.bin/.idx`).

Megatron-LM's command line, e.g.:

    python tools/preprocess_data.py --input oscar-1GB.jsonl.xz --output-prefix my-gpt2 \\
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \\
        --tokenizer-type GPT2BPETokenizer --append-eod --workers 16

The main process streams the input in bounded chunks to `--workers` processes and writes
their results in input order, so any worker count writes the same bytes. Outputs are
written under temporary names and renamed only when complete. The library is
megatron.data.preprocess.
"""

import sys

from megatron.data.preprocess import main

if __name__ == "__main__":
    sys.exit(main())
