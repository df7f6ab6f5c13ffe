"""Log lines written whole: each message with its newline in one write.

`print(text)` writes the text, then the newline: two writes. With unbuffered streams
(`python -u`, PYTHONUNBUFFERED=1, as containers and launchers often set) each is a system call
of its own, and where several ranks share a terminal or a pipe, as under torchrun, another
rank's line can land between the two (`... at iteration 6error: ...`). One write of the whole
line is one system call, which a terminal or a pipe (up to PIPE_BUF bytes) keeps together.
"""

from __future__ import annotations

import sys
from typing import Optional, TextIO


def print_line(text: str, file: Optional[TextIO] = None) -> None:
    """`text` and its newline in one write to `file` (default: the current sys.stdout), then a
    flush."""
    stream = sys.stdout if file is None else file
    stream.write(f"{text}\n")
    stream.flush()
