"""Turn a JSON-lines corpus into Megatron's mmap indexed dataset (`PREFIX_{key}_document.bin/.idx`).

The library of `tools/preprocess_data.py`, Megatron-LM's command line (its flags, `build_parser`;
its entry, `main`). The main process streams the input in bounded chunks to `--workers`
processes (megatron.data.document_encoder) and writes their results in input order, so any
worker count writes the same bytes. Outputs are written under temporary names and renamed only
when complete.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from megatron.arguments.tokenizer import add_tokenizer_args
from megatron.data.document_encoder import (
    EncodedChunk,
    EncoderSettings,
    LineProblem,
    encode_chunk,
    init_worker,
    shared_tokenizer,
)
from megatron.data.indexed_dataset import (
    MMapIndexedDatasetBuilder,
    best_fitting_dtype,
    data_file_path,
    index_file_path,
)
from megatron.data.json_lines import InputError, expand_inputs, read_line_chunks
from megatron.tokenizer.flags import TokenizerFlags

PROBLEMS_SHOWN = 10
# Input bytes handed to the workers and not yet written: with --chunk-size lines per chunk
# and 8 MiB at most per chunk (megatron.data.json_lines), a few chunks per worker.
MAX_BYTES_IN_FLIGHT = 32 << 20


def build_parser() -> argparse.ArgumentParser:
    """Megatron-LM's tools/preprocess_data.py flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    group = parser.add_argument_group("input data")
    group.add_argument(
        "--input", required=True, help="JSON-lines file or glob (.jsonl/.json, also .gz and .xz)"
    )
    group.add_argument(
        "--json-keys", nargs="+", default=["text"], help="keys to extract from each JSON object"
    )
    group.add_argument(
        "--split-sentences", action="store_true", help="split documents into sentences (NLTK Punkt)"
    )
    group.add_argument("--lang", default="english", help="language of NLTK's sentence splitter")
    group.add_argument(
        "--keep-empty",
        action="store_true",
        help="keep documents that tokenize to nothing (as one sequence: just EOD with --append-eod)",
    )
    group.add_argument(
        "--skip-invalid",
        action="store_true",
        help="skip unusable lines (bad UTF-8 or JSON, missing key, non-string value, lone surrogate) and report them at the end",
    )

    add_tokenizer_args(parser, require_type=True)
    group = parser.add_argument_group("tokenization process")
    group.add_argument(
        "--append-eod",
        action="store_true",
        help="append the end-of-document token to each document",
    )

    group = parser.add_argument_group("output data")
    group.add_argument(
        "--output-prefix", required=True, help="path of the outputs without _{key}_{level}.bin/.idx"
    )
    group.add_argument(
        "--dataset-impl", default="mmap", choices=["mmap"], help="only Megatron's mmap format"
    )

    group = parser.add_argument_group("runtime")
    group.add_argument(
        "--workers",
        type=int,
        required=True,
        help="tokenizer processes (one per core is a good default)",
    )
    group.add_argument(
        "--chunk-size", type=int, default=64, help="JSON lines handed to a worker at once"
    )
    group.add_argument(
        "--log-interval", type=int, default=1000, help="documents between progress lines"
    )
    return parser


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The flags of `argv` (sys.argv when None); argparse exits 2 on a bad value."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    if args.chunk_size < 1:
        parser.error(f"--chunk-size must be at least 1, got {args.chunk_size}")
    if args.log_interval < 1:
        parser.error(f"--log-interval must be at least 1, got {args.log_interval}")
    return args


@dataclass
class Progress:
    """Counts and rates for Megatron's `Processed N documents (X docs/s, Y MB/s).` line."""

    log_interval: int
    start: float = field(default_factory=time.time)
    documents: int = 0
    input_bytes: int = 0
    tokens: int = 0
    empty_documents: int = 0
    next_report: int = 0

    def __post_init__(self):
        self.next_report = self.log_interval

    def add(self, chunk: EncodedChunk, tokens: int) -> None:
        self.documents += chunk.documents_read
        self.input_bytes += chunk.input_bytes
        self.empty_documents += chunk.empty_documents
        self.tokens += tokens
        if self.documents >= self.next_report:
            elapsed = max(time.time() - self.start, 1e-9)
            print(
                f"Processed {self.documents} documents "
                f"({self.documents / elapsed:.2f} docs/s, {self.input_bytes / elapsed / 1024 / 1024:.2f} MB/s).",
                file=sys.stderr,
                flush=True,
            )
            self.next_report = (self.documents // self.log_interval + 1) * self.log_interval


class OutputFiles:
    """One builder per JSON key, writing to temporary names until `commit`."""

    def __init__(self, output_prefix: str, json_keys: List[str], level: str, dtype):
        self.final_prefixes = {key: f"{output_prefix}_{key}_{level}" for key in json_keys}
        suffix = f".tmp{os.getpid()}"
        self.builders = {}
        self.documents_written = {key: 0 for key in json_keys}
        self._temporary = {}
        for key, prefix in self.final_prefixes.items():
            bin_tmp = data_file_path(prefix) + suffix
            idx_tmp = index_file_path(prefix) + suffix
            self._temporary[key] = (bin_tmp, idx_tmp)
            self.builders[key] = MMapIndexedDatasetBuilder(bin_tmp, dtype=dtype)

    def add(self, chunk: EncodedChunk) -> int:
        tokens = 0
        for key, encoded in chunk.keys.items():
            builder = self.builders[key]
            builder.add_items(encoded.tokens, encoded.sequence_lengths)
            builder.end_documents(encoded.sequences_per_document)
            self.documents_written[key] += len(encoded.sequences_per_document)
            tokens += int(encoded.tokens.size)
        return tokens

    def commit(self) -> List[str]:
        """Finish both files of every key, then move them into place, the index last."""
        for key, builder in self.builders.items():
            builder.finalize(self._temporary[key][1])
        for key, prefix in self.final_prefixes.items():
            bin_tmp, idx_tmp = self._temporary[key]
            # The .idx is the commit marker: remove a stale one before the new .bin arrives.
            if os.path.exists(index_file_path(prefix)):
                os.remove(index_file_path(prefix))
            os.replace(bin_tmp, data_file_path(prefix))
            os.replace(idx_tmp, index_file_path(prefix))
        directory = os.path.dirname(os.path.abspath(next(iter(self.final_prefixes.values()))))
        _fsync_directory(directory)
        return list(self.final_prefixes.values())

    def abandon(self) -> None:
        for key, builder in self.builders.items():
            builder.abandon()
            idx_tmp = self._temporary[key][1]
            if os.path.exists(idx_tmp):
                os.remove(idx_tmp)


def _fsync_directory(directory: str) -> None:
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


class InvalidLines:
    """Problems found in the input: fatal by default, counted with --skip-invalid."""

    def __init__(self, skip: bool):
        self.skip = skip
        self.count = 0
        self.first: List[LineProblem] = []

    def record(self, problems: List[LineProblem]) -> None:
        if problems and not self.skip:
            raise InputError(f"{problems[0]} (pass --skip-invalid to skip such lines)")
        self.count += len(problems)
        self.first.extend(problems[: max(0, PROBLEMS_SHOWN - len(self.first))])

    def report(self) -> None:
        if self.count:
            shown = "; ".join(str(problem) for problem in self.first)
            more = f" (first {len(self.first)} shown)" if self.count > len(self.first) else ""
            print(f"Skipped {self.count} invalid lines{more}: {shown}", file=sys.stderr)


def run(args: argparse.Namespace) -> Dict[str, str]:
    """Preprocess the corpus; returns {json key: output prefix}."""
    tokenizer_flags = TokenizerFlags.from_args(args)
    tokenizer_flags.check()  # before the input is opened: the command line comes first
    input_paths = expand_inputs(args.input)
    tokenizer = shared_tokenizer(tokenizer_flags)
    engine = getattr(tokenizer, "engine", None)
    print(f"> {args.tokenizer_type}" + (f" on {engine}" if engine else ""), file=sys.stderr)
    dtype = best_fitting_dtype(tokenizer.vocab_size)
    settings = EncoderSettings(
        tokenizer=tokenizer_flags,
        json_keys=tuple(args.json_keys),
        append_eod=args.append_eod,
        split_sentences=args.split_sentences,
        keep_empty=args.keep_empty,
        token_dtype=dtype.__name__,
        sentence_language=args.lang,
    )
    if args.split_sentences:
        init_worker(settings)  # fail here, before any output, if NLTK is missing
    level = "sentence" if args.split_sentences else "document"
    output_directory = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(output_directory, exist_ok=True)

    print(f"Opening {', '.join(input_paths)}", file=sys.stderr)
    outputs = OutputFiles(args.output_prefix, list(args.json_keys), level, dtype)
    invalid = InvalidLines(args.skip_invalid)
    progress = Progress(args.log_interval)
    pool = multiprocessing.Pool(args.workers, initializer=init_worker, initargs=(settings,))
    # Bounded in flight, in chunks and in bytes: Pool.imap would read the whole corpus ahead
    # into its task queue. A chunk larger than the byte bound (one huge line) goes alone.
    max_in_flight = 4 * args.workers
    pending: collections.deque = collections.deque()
    pending_bytes = 0
    try:
        for path in input_paths:
            for chunk in read_line_chunks(path, args.chunk_size):
                while pending and (
                    len(pending) >= max_in_flight
                    or pending_bytes + chunk.byte_count > MAX_BYTES_IN_FLIGHT
                ):
                    pending_bytes -= _consume(pending.popleft(), outputs, invalid, progress)
                pending.append((pool.apply_async(encode_chunk, (chunk,)), chunk.byte_count))
                pending_bytes += chunk.byte_count
        while pending:
            _consume(pending.popleft(), outputs, invalid, progress)
        pool.close()
        pool.join()
        if progress.documents == 0:
            raise InputError(f"--input {args.input}: no valid documents to write")
        _refuse_all_empty(args.input, progress.documents, outputs.documents_written)
        prefixes = outputs.commit()
    except BaseException:
        pool.terminate()
        outputs.abandon()
        raise

    elapsed = max(time.time() - progress.start, 1e-9)
    invalid.report()
    if progress.empty_documents:
        print(
            f"Dropped {progress.empty_documents} empty documents (pass --keep-empty to keep them)",
            file=sys.stderr,
        )
    print(
        f"Done: {progress.documents} documents, {progress.tokens} tokens, "
        f"{progress.input_bytes / 1024 / 1024:.2f} MB in {elapsed:.2f} s "
        f"({progress.documents / elapsed:.2f} docs/s, {progress.input_bytes / elapsed / 1024 / 1024:.2f} MB/s, "
        f"{progress.tokens / elapsed:.0f} tokens/s).",
        file=sys.stderr,
    )
    for prefix in prefixes:
        print(f"Wrote {data_file_path(prefix)} and {index_file_path(prefix)}", file=sys.stderr)
    return dict(zip(args.json_keys, prefixes))


def _refuse_all_empty(input_pattern: str, documents: int, documents_written: Dict[str, int]):
    """Stop before committing a key's dataset that would hold no document (all were dropped)."""
    hollow_keys = [key for key, written in documents_written.items() if written == 0]
    if hollow_keys:
        names = " and ".join(f"'{key}'" for key in hollow_keys)
        raise InputError(
            f"--input {input_pattern}: all {documents} documents were empty (their {names} "
            "tokenized to nothing), so there is nothing to train on; "
            "--keep-empty keeps empty documents"
        )


def _consume(pending, outputs: OutputFiles, invalid: InvalidLines, progress: Progress) -> int:
    """Write one submitted chunk's result, in input order; returns its input bytes."""
    result, input_bytes = pending
    chunk: EncodedChunk = result.get()
    invalid.record(chunk.problems)
    tokens = outputs.add(chunk)
    progress.add(chunk, tokens)
    return input_bytes


def main(argv: Optional[List[str]] = None) -> int:
    """tools/preprocess_data.py: 0; 1 after one `error:` line; 130 when interrupted."""
    args = parse_args(argv)
    try:
        run(args)
    except (InputError, ValueError, RuntimeError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: no output was written", file=sys.stderr)
        return 130
    return 0
