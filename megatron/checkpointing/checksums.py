"""Checksums of checkpoint files: recorded while a file is written, verified before it is loaded.

Each file is hashed in fixed blocks (SHA-256 of bytes [k * block_size, (k + 1) * block_size)),
so hashing runs on a pool of threads beside the write at save and beside the reads at load
(hashlib releases the GIL), and a mismatch names the damaged byte range. The digests of an
iteration's files go into `checksums.json` in its directory, written before the directory is
renamed into place:

    {"format_version": 1, "algorithm": "sha256", "block_size": 67108864,
     "files": {"mp_rank_00/model_optim_rng.pt": {"size": 44301234567, "blocks": ["9f86...", ...]}}}
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import BinaryIO, Dict, List, Optional

CHECKSUMS_FILENAME = "checksums.json"
FORMAT_VERSION = 1
ALGORITHM = "sha256"
BLOCK_SIZE = 64 << 20
# Reads of one block during verification go through a buffer of this size.
_READ_SIZE = 8 << 20


def hashing_threads() -> int:
    """Threads that hash blocks: enough to outrun a disk, few enough to leave cores to others."""
    return max(1, min(8, os.cpu_count() or 1))


def _sha256(data) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class FileChecksum:
    """Size and per-block digests of one file."""

    size: int
    blocks: List[str] = field(default_factory=list)


class ChecksumWriter:
    """A write-only file object (what `torch.save` needs: `write` and `flush`) that passes every
    byte to `file` and hashes it in blocks of `block_size` on `pool`.

    Blocks that a write covers entirely are hashed straight from the caller's buffer while the
    same bytes go to the file, and the write returns once both are done (the caller may reuse
    its buffer then); the pieces of blocks that span writes are copied and hashed when complete.
    `error` keeps the first OSError of the file (or the KeyboardInterrupt of a Ctrl-C that came
    during a write), which torch.save reports only as its own RuntimeError.
    """

    def __init__(self, file: BinaryIO, pool: ThreadPoolExecutor, block_size: int = BLOCK_SIZE):
        self._file = file
        self._pool = pool
        self._block_size = block_size
        self._partial = bytearray()
        self._digests: List[Future] = []
        self.size = 0
        self.error: Optional[BaseException] = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        direct: List[Future] = []
        try:
            direct = self._queue_blocks(view)
            self._file.write(view)
        except (OSError, KeyboardInterrupt) as error:
            self.error = self.error or error
            raise
        finally:
            for future in direct:
                future.result()
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        try:
            self._file.flush()
        except (OSError, KeyboardInterrupt) as error:
            self.error = self.error or error
            raise

    def _queue_blocks(self, view: memoryview) -> List[Future]:
        """Submit the blocks `view` completes; returns those hashed from `view` itself."""
        block = self._block_size
        if self._partial:
            taken = min(block - len(self._partial), view.nbytes)
            self._partial += view[:taken]
            view = view[taken:]
            if len(self._partial) == block:
                self._digests.append(self._pool.submit(_sha256, self._partial))
                self._partial = bytearray()
        whole = view.nbytes - view.nbytes % block
        direct = [
            self._pool.submit(_sha256, view[start : start + block])
            for start in range(0, whole, block)
        ]
        self._digests.extend(direct)
        if whole < view.nbytes:
            self._partial += view[whole:]
        return direct

    def finish(self) -> FileChecksum:
        """Hash the last, partial block and return the file's checksum."""
        if self._partial:
            self._digests.append(self._pool.submit(_sha256, self._partial))
            self._partial = bytearray()
        return FileChecksum(self.size, [future.result() for future in self._digests])


def write_manifest(directory: str, files: Dict[str, FileChecksum], block_size: int) -> str:
    """Write `checksums.json` (paths relative to `directory`) and sync it; returns its path."""
    path = os.path.join(directory, CHECKSUMS_FILENAME)
    manifest = {
        "format_version": FORMAT_VERSION,
        "algorithm": ALGORITHM,
        "block_size": block_size,
        "files": {
            name: {"size": checksum.size, "blocks": checksum.blocks}
            for name, checksum in sorted(files.items())
        },
    }
    with open(path, "w") as file:
        json.dump(manifest, file, indent=1)
        file.flush()
        os.fsync(file.fileno())
    return path


@dataclass(frozen=True)
class Manifest:
    """A parsed `checksums.json`."""

    path: str
    block_size: int
    files: Dict[str, FileChecksum]


class ManifestError(ValueError):
    """`checksums.json` exists but cannot be used; the message says why."""


def read_manifest(directory: str) -> Optional[Manifest]:
    """The checksums recorded in `directory`, or None when it has no `checksums.json`."""
    path = os.path.join(directory, CHECKSUMS_FILENAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as file:
            raw = json.load(file)
        if raw["format_version"] != FORMAT_VERSION or raw["algorithm"] != ALGORITHM:
            raise ManifestError(
                f"{path} is format {raw['format_version']} / {raw['algorithm']}; this version "
                f"reads format {FORMAT_VERSION} / {ALGORITHM}"
            )
        block_size = int(raw["block_size"])
        files = {
            name: FileChecksum(int(entry["size"]), [str(digest) for digest in entry["blocks"]])
            for name, entry in raw["files"].items()
        }
    except ManifestError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ManifestError(f"{path} is unreadable ({error!r})") from None
    if block_size <= 0:
        raise ManifestError(f"{path} has block size {block_size}")
    return Manifest(path, block_size, files)


def _hash_range(fd: int, start: int, length: int) -> str:
    digest = hashlib.sha256()
    position, end = start, start + length
    while position < end:
        chunk = os.pread(fd, min(_READ_SIZE, end - position), position)
        if not chunk:
            break
        digest.update(chunk)
        position += len(chunk)
    return digest.hexdigest()


def find_damage(path: str, expected: FileChecksum, block_size: int) -> Optional[str]:
    """Compare `path` with its recorded checksum, hashing blocks on a thread pool.

    Returns None when every byte matches, else a phrase saying what differs (the size, or the
    first damaged byte range and how many blocks differ).
    """
    actual_size = os.path.getsize(path)
    if actual_size != expected.size:
        return f"it is {actual_size} bytes, but {expected.size} were written"
    expected_blocks = -(-expected.size // block_size)
    if len(expected.blocks) != expected_blocks:
        return (
            f"its checksum record lists {len(expected.blocks)} blocks, {expected_blocks} expected"
        )
    actual = _block_digests(path, expected.size, block_size)
    damaged = [
        index
        for index, (digest, recorded) in enumerate(zip(actual, expected.blocks))
        if digest != recorded
    ]
    if not damaged:
        return None
    first_start = damaged[0] * block_size
    first_end = min(first_start + block_size, expected.size)
    return f"bytes {first_start}-{first_end - 1} differ from what was written" + (
        f" ({len(damaged)} of {len(actual)} blocks differ)" if len(damaged) > 1 else ""
    )


def file_checksum(path: str, block_size: int = BLOCK_SIZE) -> FileChecksum:
    """The checksum of a file already written (by a writer that could not hash as it wrote)."""
    size = os.path.getsize(path)
    return FileChecksum(size, _block_digests(path, size, block_size))


def _block_digests(path: str, size: int, block_size: int) -> List[str]:
    """SHA-256 of each block of the first `size` bytes of `path`, hashed on a thread pool."""
    with open(path, "rb") as file, ThreadPoolExecutor(hashing_threads()) as pool:
        fd = file.fileno()
        futures = [
            pool.submit(_hash_range, fd, start, min(block_size, size - start))
            for start in range(0, size, block_size)
        ]
        return [future.result() for future in futures]
