"""Streaming reader for JSON-lines corpora (`.jsonl`/`.json`, optionally `.gz` or `.xz`).

Lines are read as raw bytes and handed out in bounded chunks, so memory stays flat whatever
the corpus size; decoding and JSON parsing happen later, in the worker processes.
"""

from __future__ import annotations

import glob
import gzip
import lzma
import os
import zlib
from dataclasses import dataclass
from typing import BinaryIO, Iterator, List


class InputError(Exception):
    """A problem with the input corpus; the message names the file and, where known, the line."""


@dataclass
class LineChunk:
    """Consecutive raw lines of one input file; `first_line` is the 1-based number of lines[0]."""

    path: str
    first_line: int
    lines: List[bytes]

    @property
    def byte_count(self) -> int:
        return sum(len(line) for line in self.lines)


def expand_inputs(pattern: str) -> List[str]:
    """Files named by `--input`: one path, or a glob pattern, in sorted order."""
    if any(character in pattern for character in "*?["):
        paths = sorted(path for path in glob.glob(pattern) if os.path.isfile(path))
        if not paths:
            raise InputError(f"--input {pattern}: the pattern matches no files")
        return paths
    if not os.path.exists(pattern):
        raise InputError(f"--input {pattern}: no such file")
    if os.path.isdir(pattern):
        raise InputError(
            f"--input {pattern} is a directory; pass a file or a glob such as '{pattern}/*.jsonl'"
        )
    return [pattern]


def open_binary(path: str) -> BinaryIO:
    """Open a corpus file for reading bytes, decompressing `.gz` and `.xz` by extension."""
    if path.endswith(".xz"):
        return lzma.open(path, "rb")
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb", buffering=1 << 20)


def read_line_chunks(path: str, max_lines: int, max_bytes: int = 8 << 20) -> Iterator[LineChunk]:
    """Yield chunks of at most `max_lines` lines (or about `max_bytes` bytes) from one file.

    Blank lines are passed through (the encoder skips them) so line numbers stay exact.
    A file with no non-blank line, or a compressed stream that is cut off or corrupt,
    raises InputError naming the file and the last line read.
    """
    line_number = 0
    saw_content = False
    lines: List[bytes] = []
    chunk_bytes = 0
    first_line = 1
    try:
        with open_binary(path) as stream:
            for line in stream:
                line_number += 1
                if not saw_content and line.strip():
                    saw_content = True
                lines.append(line)
                chunk_bytes += len(line)
                if len(lines) >= max_lines or chunk_bytes >= max_bytes:
                    yield LineChunk(path, first_line, lines)
                    first_line = line_number + 1
                    lines = []
                    chunk_bytes = 0
    except (EOFError, lzma.LZMAError, gzip.BadGzipFile, zlib.error, OSError) as error:
        raise InputError(
            f"{path}: the file is truncated or corrupt after line {line_number} ({error}); "
            "re-create or re-download it"
        ) from None
    if not saw_content:
        raise InputError(f"{path}: the file is empty (no JSON lines to process)")
    if lines:
        yield LineChunk(path, first_line, lines)
