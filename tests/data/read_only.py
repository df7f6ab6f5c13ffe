"""A dataset directory that refuses writes, also where the tests run as root (which chmod does
not stop): there, creating a file in it raises the PermissionError a read-only mount would."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import Iterator

import pytest


@contextlib.contextmanager
def read_only(directory: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`directory` read-only inside the block; its mode comes back after it (so that pytest
    can remove it)."""
    mode = directory.stat().st_mode
    refused = os.path.realpath(directory)
    original_mkstemp = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if dir is not None and os.path.realpath(dir) == refused:
            raise PermissionError(errno.EACCES, "Permission denied", dir)
        return original_mkstemp(*args, dir=dir, **kwargs)

    directory.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(tempfile, "mkstemp", mkstemp)
            yield
    finally:
        directory.chmod(mode)
