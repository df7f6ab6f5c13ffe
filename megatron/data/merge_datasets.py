"""Concatenate several Megatron mmap indexed datasets into one.

The library of tools/merge_datasets.py (its flags and entry, `main`). A directory stands for
every `.idx`/`.bin` pair in it, in sorted order (Megatron's `--input DIR` form); any other value
is a dataset prefix. Documents keep their order: first all of the first input, then the second,
and so on. The output is written under temporary names and renamed when complete.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from megatron.data.indexed_dataset import (
    IndexedDatasetError,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    data_file_path,
    dataset_exists,
    index_file_path,
)


def resolve_prefixes(inputs: List[str]) -> List[str]:
    """Dataset prefixes named by --input values (directories expand to their pairs)."""
    prefixes: List[str] = []
    for value in inputs:
        if os.path.isdir(value):
            found = sorted(
                os.path.join(value, name[: -len(".idx")])
                for name in os.listdir(value)
                if name.endswith(".idx")
                and dataset_exists(os.path.join(value, name[: -len(".idx")]))
            )
            if not found:
                raise IndexedDatasetError(
                    f"--input {value}: the directory holds no .idx/.bin pairs"
                )
            prefixes.extend(found)
        elif dataset_exists(value):
            prefixes.append(value)
        else:
            raise IndexedDatasetError(
                f"--input {value}: neither a directory nor a dataset prefix "
                f"({index_file_path(value)} and {data_file_path(value)} must both exist)"
            )
    return prefixes


def merge(prefixes: List[str], output_prefix: str) -> None:
    """Write the concatenation of the datasets at `prefixes` to `output_prefix`."""
    first = MMapIndexedDataset(prefixes[0])
    suffix = f".tmp{os.getpid()}"
    bin_tmp = data_file_path(output_prefix) + suffix
    idx_tmp = index_file_path(output_prefix) + suffix
    builder = MMapIndexedDatasetBuilder(bin_tmp, dtype=first.dtype)
    try:
        for prefix in prefixes:
            builder.merge_file_(prefix)
            print(f"Merged {prefix}", file=sys.stderr)
        builder.finalize(idx_tmp)
        if os.path.exists(index_file_path(output_prefix)):
            os.remove(index_file_path(output_prefix))
        os.replace(bin_tmp, data_file_path(output_prefix))
        os.replace(idx_tmp, index_file_path(output_prefix))
    except BaseException:
        builder.abandon()
        if os.path.exists(idx_tmp):
            os.remove(idx_tmp)
        raise


def main(argv: Optional[List[str]] = None) -> int:
    """tools/merge_datasets.py: 0, or 1 after one `error:` line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="directories or dataset prefixes to merge, in order",
    )
    parser.add_argument("--output-prefix", required=True, help="prefix of the merged .bin/.idx")
    args = parser.parse_args(argv)
    try:
        prefixes = resolve_prefixes(args.input)
        output = os.path.abspath(args.output_prefix)
        if any(os.path.abspath(prefix) == output for prefix in prefixes):
            raise IndexedDatasetError(f"--output-prefix {args.output_prefix} is also an input")
        merge(prefixes, args.output_prefix)
    except (IndexedDatasetError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    merged = MMapIndexedDataset(args.output_prefix)
    print(
        f"Wrote {args.output_prefix}: {len(merged.doc_idx) - 1} documents, {len(merged)} sequences "
        f"from {len(prefixes)} datasets",
        file=sys.stderr,
    )
    return 0
