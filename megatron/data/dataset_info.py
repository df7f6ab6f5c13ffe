"""Summarize the GPT training samples Megatron would build from a dataset, and show the first one.

The library of tools/dataset_info.py (its flags and entry, `main`): the documents, sequences and
tokens of each dataset prefix, then each split's samples as megatron.data.gpt_dataset builds
them, and, given a tokenizer, the start of each split's first sample as text.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from megatron.arguments.tokenizer import add_tokenizer_args
from megatron.data.dataset_splits import parse_data_path
from megatron.data.gpt_dataset import SPLIT_NAMES, build_train_valid_test_datasets
from megatron.data.indexed_dataset import IndexedDatasetError, MMapIndexedDataset
from megatron.tokenizer import TokenizerFlags, build_tokenizer_from_flags


def main(argv: Optional[List[str]] = None) -> int:
    """tools/dataset_info.py: 0, or 1 after one `error:` line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument(
        "--data-path", nargs="+", required=True, help="prefix, or weight prefix pairs"
    )
    parser.add_argument("--split", default="969,30,1")
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--train-samples", type=int, default=1000)
    parser.add_argument("--valid-samples", type=int, default=100)
    parser.add_argument("--test-samples", type=int, default=10)
    add_tokenizer_args(parser)
    parser.add_argument(
        "--data-cache-path", help="directory for the index caches (default: beside the data)"
    )
    args = parser.parse_args(argv)
    tokenizer = None
    # A preview needs a tokenizer's files (or NullTokenizer's --vocab-size); none given, none shown.
    if args.vocab_file or args.tokenizer_model or args.tokenizer_type == "NullTokenizer":
        try:
            tokenizer = build_tokenizer_from_flags(TokenizerFlags.from_args(args))
        except (OSError, ValueError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
    try:
        for prefix in parse_data_path(args.data_path).prefixes:
            dataset = MMapIndexedDataset(prefix)
            print(
                f"{prefix}: {len(dataset.doc_idx) - 1} documents, {len(dataset)} sequences, "
                f"{int(dataset.sizes.sum(dtype='int64'))} tokens ({dataset.dtype})"
            )
        datasets = build_train_valid_test_datasets(
            args.data_path,
            args.split,
            [args.train_samples, args.valid_samples, args.test_samples],
            args.seq_length,
            args.seed,
            cache_path=args.data_cache_path,
        )
    except (IndexedDatasetError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for name, dataset in zip(SPLIT_NAMES, datasets):
        if dataset is None:
            print(f"{name}: empty split")
            continue
        sample = dataset[0]["text"]
        print(f"{name}: {len(dataset)} samples of {len(sample)} tokens (seq-length + 1)")
        if tokenizer is not None:
            preview = tokenizer.detokenize(sample[:48].tolist()).replace("\n", " ")
            print(f"  first sample starts: {preview!r}")
    return 0
