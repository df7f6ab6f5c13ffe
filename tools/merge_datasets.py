"""Concatenate several Megatron mmap indexed datasets into one.

    python tools/merge_datasets.py --input DIR_OR_PREFIX [DIR_OR_PREFIX ...] --output-prefix OUT

A directory stands for every `.idx`/`.bin` pair in it, in sorted order (Megatron's
`--input DIR` form); any other value is a dataset prefix. Documents keep their order:
first all of the first input, then the second, and so on. The output is written under
temporary names and renamed when complete. The library is megatron.data.merge_datasets.
"""

import sys

from megatron.data.merge_datasets import main

if __name__ == "__main__":
    sys.exit(main())
