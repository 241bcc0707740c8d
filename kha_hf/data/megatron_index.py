"""A Megatron-LM / Megatron-core indexed dataset (`PREFIX.bin` + `PREFIX.idx`), read and checked for adoption.

`PREFIX.idx`, as megatron/core/datasets/indexed_dataset.py (`_IndexWriter`) writes it, all little-endian:

    b"MMIDIDX\\x00\\x00"        9 bytes of magic
    version        <Q        1
    dtype code     <B        1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    sequences      <Q        S
    doc entries    <Q        D: the number of documents + 1
    lengths        int32[S]  tokens a sequence
    pointers       int64[S]  byte offset of each sequence in PREFIX.bin (0, then each the previous one's end)
    doc index      int64[D]  the sequence each document starts at: 0 first, S last, never decreasing
    modes          int8[S]   only in multimodal datasets (newer megatron-core); not read

`PREFIX.bin` is the sequences' ids back to back. The whole index is checked before a token is read (a file of the
size its counts say, lengths >= 0, pointers contiguous and in order up to exactly the size of the .bin, document
indices in order and in range), in slices of SLICE entries: what a check holds does not grow with the dataset.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..common.errors import KHAError

MAGIC = b"MMIDIDX\x00\x00"
HEADER = len(MAGIC) + 8 + 1 + 8 + 8  # 34 bytes
DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}
SLICE = 1 << 20  # index entries read at once (8 MiB of pointers)


@dataclass(frozen=True)
class MegatronIndex:
    """A checked `PREFIX.idx`: the ids' dtype, S sequences, D document entries, where each array starts."""

    idx: Path
    bin: Path
    dtype: np.dtype  # little-endian, as stored in PREFIX.bin
    sequences: int
    entries: int  # document index entries: documents + 1
    tokens: int  # ids in PREFIX.bin
    stamp: tuple[int, int, int, int] | None = None  # PREFIX.idx's (device, inode, size, mtime) when it was checked

    @property
    def _pointers_at(self) -> int:
        return HEADER + 4 * self.sequences

    @property
    def _documents_at(self) -> int:
        return HEADER + 12 * self.sequences

    def document_ends(self) -> Iterator[np.ndarray]:
        """The token offset in PREFIX.bin where each non-empty document ends, ascending, as int64 arrays of at most
        SLICE entries (an empty document, two equal entries of the document index, ends nowhere)."""
        previous = 0
        for starts in _slices(self.idx, self._documents_at + 8, self.entries - 1, np.int64, self.stamp):  # [1:]
            while starts.size:
                first = int(starts[0])
                if first == self.sequences:  # the documents that end with the last sequence end with the file
                    ends, starts = np.full(starts.size, self.tokens, np.int64), starts[:0]
                else:
                    count = min(SLICE, self.sequences - first)
                    window = _read(self.idx, self._pointers_at + 8 * first, count, "<i8", self.stamp)
                    k = int(np.searchsorted(starts, first + window.size))
                    ends, starts = window[starts[:k] - first] // self.dtype.itemsize, starts[k:]
                ends = ends[np.diff(ends, prepend=previous) > 0]
                if ends.size:
                    previous = int(ends[-1])
                    yield ends


def read_megatron_index(name: str | Path) -> MegatronIndex:
    """The checked index of the dataset NAME (its prefix, or its .bin or .idx path); one-line KHAError otherwise."""
    prefix = str(name)[:-4] if str(name).endswith((".bin", ".idx")) else str(name)
    idx, bin_ = Path(prefix + ".idx").absolute(), Path(prefix + ".bin").absolute()
    fd = open_regular(idx)
    with os.fdopen(fd, "rb") as f:
        head = f.read(HEADER)
        info = os.fstat(f.fileno())
    size, stamp = info.st_size, file_stamp(info)
    if len(head) < HEADER:
        raise KHAError(f"{idx} is truncated: {len(head)} bytes, shorter than the {HEADER}-byte Megatron index header")
    if head[: len(MAGIC)] != MAGIC:
        raise KHAError(f"{idx} does not start with {MAGIC!r}: not a Megatron-LM indexed dataset's .idx")
    version, code, sequences, entries = struct.unpack_from("<QBQQ", head, len(MAGIC))
    if version != 1:
        raise KHAError(f"{idx} is Megatron index version {version}; the format read here is version 1")
    if code not in DTYPES or DTYPES[code].startswith("float"):
        raise KHAError(f"{idx}: dtype code {code} is {DTYPES.get(code, 'unknown')}, not an integer token id type")
    arrays = HEADER + 12 * sequences + 8 * entries
    if size not in (arrays, arrays + sequences):  # + the int8 sequence modes of a multimodal dataset
        raise KHAError(
            f"{idx} holds {size:,} bytes, not the {arrays:,} (or {arrays + sequences:,} with sequence modes) its "
            f"counts of {sequences:,} sequences and {entries:,} document entries say: truncated or damaged"
        )
    if entries < 2:
        raise KHAError(f"{idx} holds no document ({entries} document index entries): an empty dataset")
    dtype = np.dtype(DTYPES[code]).newbyteorder("<")
    index = MegatronIndex(idx, bin_, dtype, sequences, entries, os.path.getsize(bin_) // dtype.itemsize, stamp)
    _check_sequences(index, os.path.getsize(bin_))
    _check_documents(index)
    return index


def _check_sequences(index: MegatronIndex, bin_bytes: int) -> None:
    """Lengths >= 0 and pointers that tile PREFIX.bin from byte 0 to its last byte, in order."""
    if index.sequences == 0:
        raise KHAError(f"{index.idx} holds no sequence: an empty dataset")
    end, item = 0, index.dtype.itemsize
    lengths = _slices(index.idx, HEADER, index.sequences, np.int32, index.stamp)
    pointers = _slices(index.idx, index._pointers_at, index.sequences, np.int64, index.stamp)
    for first, (length, pointer) in enumerate(zip(lengths, pointers, strict=True)):
        if int(length.min()) < 0:
            raise KHAError(f"{index.idx}: a sequence length is negative ({int(length.min())}): a damaged index")
        starts = end + np.concatenate(([0], np.cumsum(length[:-1].astype(np.int64) * item)))
        wrong = np.flatnonzero(pointer != starts)
        if wrong.size:
            at = first * SLICE + int(wrong[0])
            raise KHAError(
                f"{index.idx}: sequence {at:,} starts at byte {int(pointer[wrong[0]]):,} of the .bin, not at "
                f"{int(starts[wrong[0]]):,} where the one before it ends: pointers not contiguous and in order"
            )
        end = int(starts[-1]) + int(length[-1]) * item
        if end > bin_bytes:
            raise KHAError(f"{index.idx}: its sequences reach byte {end:,}, past the {bin_bytes:,} of {index.bin}")
    if end != bin_bytes:
        raise KHAError(f"{index.idx}: its sequences end at byte {end:,}, but {index.bin} holds {bin_bytes:,} bytes")


def _check_documents(index: MegatronIndex) -> None:
    """Document starts from 0 to S, never decreasing."""
    previous = last = 0
    for first, starts in enumerate(_slices(index.idx, index._documents_at, index.entries, np.int64, index.stamp)):
        steps = np.diff(starts, prepend=previous)
        if int(starts.min()) < 0 or int(starts.max()) > index.sequences or int(steps.min()) < 0:
            at = first * SLICE + int(np.flatnonzero((steps < 0) | (starts < 0) | (starts > index.sequences))[0])
            raise KHAError(
                f"{index.idx}: document index entry {at:,} is {int(starts[at - first * SLICE]):,}: out of order or "
                f"out of the 0 to {index.sequences:,} sequences"
            )
        if first == 0 and int(starts[0]) != 0:
            raise KHAError(f"{index.idx}: the document index starts at sequence {int(starts[0])}, not 0")
        previous = last = int(starts[-1])
    if last != index.sequences:
        raise KHAError(
            f"{index.idx}: the document index ends at sequence {last}, not at the {index.sequences:,} sequences "
            "(sequences outside any document)"
        )


def _slices(path: Path, offset: int, count: int, dtype, stamp=None) -> Iterator[np.ndarray]:
    """COUNT little-endian DTYPE values at byte OFFSET of PATH, in arrays of at most SLICE."""
    for first in range(0, count, SLICE):
        yield _read(path, offset + first * np.dtype(dtype).itemsize, min(SLICE, count - first), dtype, stamp)


def _read(path: Path, offset: int, count: int, dtype, stamp=None) -> np.ndarray:
    """COUNT values at OFFSET of PATH, which must still be the file STAMP describes: an index rewritten or replaced
    after its check is refused, never read unchecked."""
    dtype = np.dtype(dtype).newbyteorder("<")
    with os.fdopen(open_regular(path), "rb") as f:
        if stamp is not None and file_stamp(os.fstat(f.fileno())) != stamp:
            raise KHAError(f"{path} changed while it was read: adopt it again")
        data = os.pread(f.fileno(), count * dtype.itemsize, offset)
    if len(data) != count * dtype.itemsize:
        raise KHAError(f"{path} is shorter than when it was checked: it changed while it was read")
    return np.frombuffer(data, dtype=dtype)


def file_stamp(info: os.stat_result) -> tuple[int, int, int, int]:
    """(device, inode, size, modification time) of INFO: what tells a file rewritten or replaced since."""
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


def open_regular(path: Path) -> int:
    """A read-only descriptor of PATH if it is a regular file, opened without blocking: a FIFO put in a file's place
    after an earlier check is refused here, never waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise KHAError(f"cannot read {path}: {err.strerror or err}") from err
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise KHAError(f"{path} is not a regular file (a FIFO, socket or device): not a token file")
    return fd
