"""Per-chunk hashes of a prepared corpus's `tokens.bin`, checked as training reads its blocks (#70 item 6).

`kha tokenize` hashes the token file in chunks of CHUNK_BYTES (16 MiB) as it writes it, and keeps the digests in
`tokens.chunks` (32 bytes a chunk: 4 MB for 10^12 uint16 tokens), whose own SHA-256 the manifest records. A reader
checks a chunk the first time one of its blocks is read in a process: it reads the whole chunk once more and
hashes it. A token file replaced by other bytes of the same size is refused at the first block read from a changed
chunk, not after training on it.

Why not the whole file's SHA-256 at the start (the manifest's `tokens_sha256`, still written): it reads the whole
corpus before the first step (about 20 minutes for 2 TB at 2 GB/s), and again on every rank. The chunk check costs,
over a run, at most one more read of the chunks a process touches (the whole corpus once per process in a run of at
least an epoch), and the memory of one bit a chunk. The loader's rate with the check has not been measured yet
(`benchmarks/corpus_scale.py` measures the loader; its recorded table predates the check). A corpus prepared before
`tokens.chunks` existed is read unchecked, as before.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ..common.errors import KHAError

CHUNKS = "tokens.chunks"
CHUNK_BYTES = 16 << 20
DIGEST = 32  # bytes of a SHA-256 digest
_READ = 4 << 20  # a chunk is hashed in pieces of this size: what a check holds at once


class ChunkHasher:
    """The digests of consecutive CHUNK-byte chunks of a stream written in pieces of any size."""

    def __init__(self, chunk: int = CHUNK_BYTES) -> None:
        self.chunk, self.digests = chunk, bytearray()
        self._current, self._filled = hashlib.sha256(), 0

    def update(self, data: bytes) -> None:
        view = memoryview(data)
        while len(view):
            take = min(len(view), self.chunk - self._filled)
            self._current.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.chunk:
                self.digests += self._current.digest()
                self._current, self._filled = hashlib.sha256(), 0

    def finish(self) -> bytes:
        """Every chunk's digest, the last (shorter) one included."""
        if self._filled:
            self.digests += self._current.digest()
            self._current, self._filled = hashlib.sha256(), 0
        return bytes(self.digests)


def read_chunk_digests(folder: Path, manifest: dict, size: int) -> tuple[int, bytes] | None:
    """(chunk bytes, digests) that FOLDER's manifest records for its token file of SIZE bytes, or None for a corpus
    prepared before they were; one-line KHAError for a record or a `tokens.chunks` that is not what was written."""
    chunk = manifest.get("chunk_bytes")
    if chunk is None:
        return None
    if type(chunk) is not int or not 4096 <= chunk <= 1 << 30:
        raise KHAError(f"{folder / 'manifest.json'}: chunk_bytes {chunk!r} is not what kha tokenize writes")
    path = folder / CHUNKS
    if path.is_symlink() or not path.is_file():
        raise KHAError(f"{path} is missing or not a regular file: the corpus is damaged; prepare it again")
    expected = -(-size // chunk) * DIGEST
    if path.stat().st_size != expected:
        raise KHAError(f"{path} holds {path.stat().st_size} bytes, not {expected}: the corpus is damaged")
    digests = path.read_bytes()
    if hashlib.sha256(digests).hexdigest() != manifest.get("chunks_sha256"):
        raise KHAError(f"{path} is not the one its manifest records: the corpus changed; prepare it again")
    return chunk, digests


class ChunkCheck:
    """Checks each chunk of a token file against its digest the first time a read touches it (one bit a chunk)."""

    def __init__(self, chunk: int, digests: bytes) -> None:
        self.chunk, self.digests = chunk, digests
        self.checked = bytearray(-(-len(digests) // DIGEST // 8) or 1)

    def check(self, fd: int, path: Path, offset: int, length: int) -> None:
        """The chunks holding bytes OFFSET to OFFSET + LENGTH of PATH (open as FD) are as written, or KHAError."""
        for k in range(offset // self.chunk, (offset + max(length, 1) - 1) // self.chunk + 1):
            if self.checked[k >> 3] & (1 << (k & 7)):
                continue
            digest, start = hashlib.sha256(), k * self.chunk
            for at in range(start, start + self.chunk, _READ):
                piece = os.pread(fd, min(_READ, start + self.chunk - at), at)
                digest.update(piece)
                if len(piece) < _READ:
                    break
            if digest.digest() != self.digests[k * DIGEST : (k + 1) * DIGEST]:
                raise KHAError(
                    f"{path} is not the token file kha tokenize wrote (its bytes {start:,} to {start + self.chunk:,} "
                    "changed): the corpus changed since it was prepared; prepare it again"
                )
            self.checked[k >> 3] |= 1 << (k & 7)
