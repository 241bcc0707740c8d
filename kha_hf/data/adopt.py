"""`kha tokenize FILE... --from-tokens FORMAT`: adopt token files another tool wrote as a prepared corpus (corpus.py),
without tokenizing again: a nanoGPT `.bin` (uint16 ids, documents separated by EOS), a Megatron-LM indexed dataset
(`PREFIX.bin` + `PREFIX.idx`, megatron_index.py) or dolma / OLMo-core `.npy` files (raw ids, or NumPy's format).

Why a hard link: a corpus's tokens.bin is the flat little-endian uint16 or uint32 stream that a nanoGPT train.bin, a
uint16/int16/int32 Megatron .bin and a raw uint16/uint32/int32 OLMo file already are (a non-negative id has the same
bytes signed or not). One such file becomes tokens.bin by `os.link`: no copy and no disk however large, and the
source is never opened for writing, moved or changed (deleting the corpus, or a failed run, removes the link only).
The corpus shares the source's bytes: a tool that later rewrites the source in place changes the corpus too, and
training refuses it then (the chunk digests, and the source's size and time in the manifest).
A link cannot cross file systems, and some bytes must change (several files joined, a `.npy` header, uint8 or int64
ids, Megatron documents without a final EOS): `copy` then streams the ids into a new tokens.bin; without it the
adoption is refused in one line, never a silent copy of terabytes.

What is checked, in one pass over each source in pieces of READ_BYTES (memory flat in the corpus's size): a regular
file (never a FIFO or a device; a named link is followed, as sources.py does), a Megatron index whole before any id,
every id below the tokenizer's size and no negative one, each Megatron document ending with the tokenizer's EOS, and
no source changing while it is read. The same pass computes what `kha tokenize` records: tokens_sha256, the 16-MiB
chunk digests of tokens.chunks, the largest id and the documents (EOS tokens; Megatron's own count).

What it costs: one sequential read of the sources, with two SHA-256s over every byte (tokens.bin's and its chunks',
on two threads; a third, the source's own, when copying) and a few numpy reductions a piece. Linked, it writes only
the tokenizer, tokens.chunks (32 bytes a 16 MiB) and the manifest. benchmarks/adopt_scale.py --quick on 2 shared CPU
cores: about 390 MiB/s linked, 130 MiB/s copied (the disk's write rate), a peak RSS of about 400 MiB (the
interpreter and its imports) for 16 and 64 MiB files alike.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..checkpoint.output import atomic_output_dir, check_free_space
from ..checkpoint.paths import check_run_destination
from ..common.errors import KHAError
from .chunks import CHUNK_BYTES, DIGEST, ChunkHasher
from .corpus import TOKENS
from .megatron_index import MegatronIndex, file_stamp, open_regular, read_megatron_index
from .prepare import (
    DEFAULT_EVAL_FRACTION,
    DEFAULT_MAX_EVAL_TOKENS,
    CorpusStream,
    check_eval_options,
    corpus_dtype,
    corpus_manifest,
    load_corpus_tokenizer,
    report_corpus,
    save_corpus_tokenizer,
    write_chunk_digests,
    write_manifest,
)
from .sources import SKIP_KINDS, Source, looks_like_hub_dataset

FORMATS = ("nanogpt", "megatron", "numpy")
READ_BYTES = 8 << 20  # ids read, checked and hashed at once
MAX_NPY_HEADER = 1 << 16  # bytes: numpy's own headers of a 1-D array are under 200
NPY_DTYPES = ("<u2", "<u4", "<i2", "<i4")  # what a NumPy-format token file may hold
SAME_BYTES = {"u2": "uint16", "i2": "uint16", "u4": "uint32", "i4": "uint32"}  # kind + size -> the corpus dtype


@dataclass
class TokenFile:
    """One file of ids: TOKENS ids of DTYPE (little-endian) from byte OFFSET of PATH (after a .npy header)."""

    path: Path  # absolute, as named: a link is followed when it is read
    identity: tuple[int, int]  # (st_dev, st_ino) when named: the file read (or linked) must be this one
    dtype: np.dtype
    offset: int
    tokens: int
    index: MegatronIndex | None = None


def adopt_tokens(
    sources: list[str],
    tokenizer: str | Path,
    output: str | Path,
    from_tokens: str,
    copy: bool = False,
    dtype: str | None = None,
    eval_fraction: float = DEFAULT_EVAL_FRACTION,
    max_eval_tokens: int = DEFAULT_MAX_EVAL_TOKENS,
    overwrite: bool = False,
    disable_tqdm: bool = False,
) -> dict:
    """Adopt the token files SOURCES (FROM_TOKENS: one of FORMATS) as the new corpus folder OUTPUT for TOKENIZER;
    returns the manifest. COPY: write a new tokens.bin instead of hard-linking; DTYPE: a raw numpy file's ids
    ("uint16" or "uint32"; default the tokenizer's corpus dtype). Splits as `kha tokenize` cuts them."""
    _check_options(from_tokens, dtype)
    check_eval_options(eval_fraction, max_eval_tokens)
    named = [_named_paths(name, from_tokens) for name in sources or [""]]
    _check_named_once([path for paths in named for path in paths])
    final = check_run_destination(output, [tokenizer], [p for paths in named for p in paths], overwrite)
    tok, size = load_corpus_tokenizer(tokenizer)
    files = [_token_file(paths[0], from_tokens, dtype, corpus_dtype(size)) for paths in named]
    target = _corpus_dtype(files, corpus_dtype(size))
    if not copy and (reason := _rewrite_reason(files, target)):
        raise KHAError(
            f"{reason}: that needs a new tokens.bin; pass --copy to write one (the sources stay as they are)"
        )
    if copy:
        room = sum(f.tokens + (f.index.entries if f.index else 1) for f in files) * target.itemsize
        check_free_space(final.parent, room + room // CHUNK_BYTES * DIGEST, "the adopted corpus")
    with atomic_output_dir(final, overwrite=overwrite, marker="corpus") as out:
        save_corpus_tokenizer(tok, out, final)
        adoption = _Adoption(out, target, tok.eos_token_id, size, linked=not copy)
        started = time.perf_counter()
        records = adoption.run(files, disable_tqdm)
        seconds = time.perf_counter() - started
        manifest = adoption.manifest(tok, str(tokenizer), records, eval_fraction, max_eval_tokens)
        manifest["adopted"] = {
            "format": from_tokens,
            "linked": not copy,
            "source_dtypes": sorted({f.dtype.name for f in files}),
            "eos_inserted": adoption.inserted,
        }
        write_manifest(out, manifest)
    report_corpus(manifest, final)
    how = "hard-linked" if not copy else "copied"
    rate = adoption.tokens * target.itemsize / 2**20 / max(seconds, 1e-9)
    print(f"adopted ({how}): checked at {rate:,.0f} MiB/s ({seconds:.1f} s)")
    return manifest


def _check_options(fmt: str, dtype: str | None) -> None:
    if fmt not in FORMATS:
        raise KHAError(f"--from-tokens {fmt!r} is not one of {', '.join(FORMATS)}")
    if dtype is not None and (fmt != "numpy" or dtype not in ("uint16", "uint32")):
        raise KHAError("--dtype (uint16 or uint32) applies to --from-tokens numpy only: the other formats state theirs")


def _named_paths(name: str, fmt: str) -> list[Path]:
    """The files NAME stands for (a Megatron prefix: its .bin and .idx), each a regular file, or KHAError."""
    if not str(name).strip():
        raise KHAError("name at least one token file (an empty name: a variable that was not set?)")
    if fmt == "megatron":
        prefix = str(name)[:-4] if str(name).endswith((".bin", ".idx")) else str(name)
        paths = [Path(prefix + ".bin").expanduser(), Path(prefix + ".idx").expanduser()]
    else:
        paths = [Path(name).expanduser()]
    for path in paths:
        if not (path.exists() or path.is_symlink()):
            if looks_like_hub_dataset(str(name)) and not Path(name).suffix:
                raise KHAError(
                    f"{name}: no such file; --from-tokens adopts local token files (a Hub dataset of text is "
                    "tokenized by kha tokenize without --from-tokens)"
                )
            what = " (a Megatron dataset is PREFIX.bin beside PREFIX.idx)" if fmt == "megatron" else ""
            raise KHAError(f"{path}: no such file{what}")
        _regular(path)
    return [path.absolute() for path in paths]


def _regular(path: Path) -> os.stat_result:
    """PATH's stat (a link followed: what would be read) when it is a non-empty regular file, else KHAError."""
    try:
        info = os.stat(path)
    except OSError as err:
        raise KHAError(f"{path}: cannot read it ({err.strerror or err})") from err
    if stat.S_ISDIR(info.st_mode):
        raise KHAError(f"{path} is a folder: name the token files themselves")
    if not stat.S_ISREG(info.st_mode):
        raise KHAError(f"{path} is not a regular file (a FIFO, device or socket, or a link to one)")
    if info.st_size == 0:
        raise KHAError(f"{path} is empty: no token to adopt")
    return info


def _check_named_once(paths: list[Path]) -> None:
    seen: dict = {}
    for path in paths:  # links followed: a file named twice (or through a link) would be joined to itself
        info = os.stat(path)
        key = (info.st_dev, info.st_ino)
        if key in seen:
            raise KHAError(f"{path} is named twice among the sources (also as {seen[key]}): name it once")
        seen[key] = path


def _token_file(path: Path, fmt: str, dtype: str | None, natural: str) -> TokenFile:
    """PATH's ids as FMT lays them out (DTYPE: --dtype, for numpy files; NATURAL: the tokenizer's corpus dtype, a
    raw numpy file's without it), or a one-line KHAError."""
    info = os.stat(path)
    identity = (info.st_dev, info.st_ino)
    if fmt == "megatron":
        index = read_megatron_index(path)
        if index.tokens == 0:
            raise KHAError(f"{index.bin} holds no token: an empty dataset")
        return TokenFile(path, identity, index.dtype, 0, index.tokens, index)
    layout = _npy_layout(path, info.st_size) if fmt == "numpy" else None
    if layout is not None:
        if dtype is not None and layout[0].name != dtype:
            raise KHAError(f"{path}: its .npy header says {layout[0].name} ids, not the --dtype {dtype}")
        if layout[2] == 0:
            raise KHAError(f"{path} holds no token: an empty array")
        return TokenFile(path, identity, *layout)
    stored = np.dtype((dtype or natural) if fmt == "numpy" else "uint16").newbyteorder("<")
    if info.st_size % stored.itemsize:
        raise KHAError(f"{path} holds {info.st_size:,} bytes, not a whole number of {stored.name} ids")
    return TokenFile(path, identity, stored, 0, info.st_size // stored.itemsize)


def _npy_layout(path: Path, size: int) -> tuple[np.dtype, int, int] | None:
    """(dtype, header bytes, ids) of a NumPy-format file, or None for raw ids (no `\\x93NUMPY` magic)."""
    with os.fdopen(open_regular(path), "rb") as f:
        start = f.read(12)
        if start[:6] != b"\x93NUMPY":
            return None
        # numpy reads the whole header its length field states (up to 4 GiB in version 2.0) before checking it: a
        # header of a token array is a few hundred bytes, so a longer one is refused before numpy reads it
        stated = struct.unpack_from("<H" if start[6:7] == b"\x01" else "<I", start, 8)[0] if len(start) >= 12 else 0
        if stated > MAX_NPY_HEADER:
            raise KHAError(f"{path} states a .npy header of {stated:,} bytes: not a token array's")
        f.seek(0)
        try:
            version = np.lib.format.read_magic(f)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f"version {version[0]}.{version[1]} (1.0 and 2.0 are read)")
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f)
        except ValueError as err:
            raise KHAError(f"{path} has a .npy header that cannot be read: {' '.join(str(err).split())}") from err
        offset = f.tell()
    if len(shape) != 1 or fortran or dtype.str not in NPY_DTYPES:
        layout = f"{'x'.join(map(str, shape)) or '0-d'} {'Fortran-order ' if fortran else ''}{dtype.str}"
        raise KHAError(f"{path} holds a {layout} array; token ids are one C-order array of {', '.join(NPY_DTYPES)}")
    if size != offset + shape[0] * dtype.itemsize:
        raise KHAError(f"{path} holds {size:,} bytes, not the {offset + shape[0] * dtype.itemsize:,} its header says")
    return dtype, offset, shape[0]


def _corpus_dtype(files: list[TokenFile], natural: str) -> np.dtype:
    """The sources' width where they share one a corpus has (their bytes can stay as they are), else NATURAL."""
    kinds = {f"{f.dtype.kind}{f.dtype.itemsize}" for f in files}
    widths = {SAME_BYTES.get(kind) for kind in kinds}
    return np.dtype(widths.pop() if len(widths) == 1 and None not in widths else natural).newbyteorder("<")


def _rewrite_reason(files: list[TokenFile], target: np.dtype) -> str | None:
    """Why the sources' bytes cannot be tokens.bin as they are, or None (one file of TARGET's bytes)."""
    if len(files) > 1:
        return f"{len(files)} files are joined into one token stream"
    file = files[0]
    if file.offset:
        return f"{file.path} has a {file.offset}-byte .npy header before its ids"
    if SAME_BYTES.get(f"{file.dtype.kind}{file.dtype.itemsize}") != target.name:
        return f"{file.path} holds {file.dtype.name} ids, which a corpus stores as {target.name}"
    return None


class _Adoption:
    """One pass over the sources: every id checked, tokens.bin written (or, linked, read as it is), hashed."""

    def __init__(self, out: Path, target: np.dtype, eos: int, size: int, linked: bool) -> None:
        self.out, self.target, self.eos, self.size, self.linked = out, target, eos, size, linked
        self.digest, self.chunks = hashlib.sha256(), ChunkHasher()
        self.tokens, self.max_id, self.inserted, self.last = 0, -1, 0, None
        self.pool, self.pending = None, []  # whole-file digests, hashed beside the chunks' (hashlib frees the GIL)

    def run(self, files: list[TokenFile], disable_tqdm: bool) -> list[Source]:
        """Each file's source record(s), in order; tokens.bin complete and synced."""
        from tqdm.auto import tqdm

        total = sum(f.tokens * f.dtype.itemsize for f in files)
        bar = tqdm(total=total, desc="checking", unit="B", unit_scale=True, disable=disable_tqdm, smoothing=0.1)
        try:
            with ThreadPoolExecutor(2, thread_name_prefix="kha-adopt-hash") as self.pool, self._output() as sink:
                records = [record for file in files for record in self._file(file, sink, bar)]
                if sink is not None:
                    sink.flush()
                    os.fsync(sink.fileno())
        except OSError as err:
            raise KHAError(f"cannot adopt into {self.out.parent}: {err.strerror or err}") from err
        finally:
            bar.close()
        return records

    @contextlib.contextmanager
    def _output(self):
        if self.linked:
            yield None
            return
        with open(self.out / TOKENS, "wb") as sink:
            yield sink

    def manifest(self, tok, name: str, records: list[Source], eval_fraction: float, max_eval_tokens: int) -> dict:
        """The manifest `kha tokenize` would write for this stream (tokens.chunks written here), without "adopted"."""
        chunks_sha256 = write_chunk_digests(self.out, self.chunks.finish())
        documents = sum(r.documents for r in records)
        stream = CorpusStream(
            self.target.name, self.tokens, self.digest.hexdigest(), chunks_sha256, self.max_id, documents
        )
        manifest = corpus_manifest(tok, name, stream, eval_fraction, max_eval_tokens)
        manifest["skipped"] = dict.fromkeys(SKIP_KINDS, 0)
        manifest["sources"] = [r.record() for r in records]
        return manifest

    def _file(self, file: TokenFile, sink, bar) -> list[Source]:
        source = Source(str(file.path), "file")
        digest = None if self.linked else hashlib.sha256()  # linked, the file's digest is tokens.bin's
        if self.linked:
            _link(file.path, self.out / TOKENS)
        fd = _open_checked(self.out / TOKENS if self.linked else file.path, file.identity)
        try:
            before = os.fstat(fd)
            if digest is not None:
                digest.update(os.pread(fd, file.offset, 0))
            if self.last is not None and self.last != self.eos and file.index is None:
                self._add(np.asarray([self.eos], self.target), sink, self.eos)  # the last document of the file before
                self.inserted += 1
                self._settle()
            source.documents = self._ids(fd, file, sink, digest, bar)
            after = os.fstat(fd)
        finally:
            os.close(fd)
        if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            raise KHAError(f"{file.path} changed while it was read: adopt it once nothing writes to it")
        source.bytes, source.mtime_ns = after.st_size, after.st_mtime_ns
        source.sha256 = (digest or self.digest).hexdigest()
        if file.index is None:
            return [source]
        return [source, _index_record(file.index)]

    def _ids(self, fd: int, file: TokenFile, sink, digest, bar) -> int:
        """Check, convert and write FILE's ids; returns its documents."""
        ends = _Ends(file.index.document_ends()) if file.index else None
        item, documents, eos_seen, at = file.dtype.itemsize, 0, 0, 0
        buffer = bytearray(READ_BYTES)
        while at < file.tokens:
            n = min(READ_BYTES // item, file.tokens - at)
            view = memoryview(buffer)[: n * item]
            if os.preadv(fd, [view], file.offset + at * item) != len(view):
                raise KHAError(f"{file.path} is shorter than when it was checked: it changed while it was read")
            if digest is not None:
                self._later(digest.update, view)
            ids = np.frombuffer(view, dtype=file.dtype)
            top = self._checked(ids, file, at)
            out = ids if ids.dtype.itemsize == self.target.itemsize else ids.astype(self.target)
            if ends is not None:
                out, found = self._document_ends(out, ids, ends.upto(at + n) - at, file, at)
                documents += found
            else:
                eos_seen += int(np.count_nonzero(ids == self.eos))
            self._add(out, sink, max(top, self.eos) if out.size > n else top)
            self._settle()  # before BUFFER is read into again
            at += n
            bar.update(len(view))
        return documents if ends is not None else eos_seen + (self.last != self.eos)

    def _later(self, update, data) -> None:
        """UPDATE(DATA) on a hashing thread; DATA must stay as it is until `_settle`."""
        self.pending.append(self.pool.submit(update, data))

    def _settle(self) -> None:
        """Wait for the hashing threads (and raise what they raised)."""
        for future in self.pending:
            future.result()
        self.pending.clear()

    def _checked(self, ids: np.ndarray, file: TokenFile, at: int) -> int:
        """The largest of IDS (ids AT.. of FILE), or KHAError naming the first negative or too large one."""
        if ids.dtype.kind == "i" and int(ids.min()) < 0:
            bad = int(np.argmax(ids < 0))
            raise KHAError(f"{file.path}: token id {int(ids[bad])} at byte {file.offset + (at + bad) * ids.itemsize:,}"
                           " is negative: not token ids, or not this dtype")  # fmt: skip
        top = int(ids.max())
        if top >= self.size:
            bad = int(np.argmax(ids >= self.size))
            raise KHAError(
                f"{file.path}: token id {int(ids[bad])} at byte {file.offset + (at + bad) * ids.itemsize:,} is past "
                f"the tokenizer's {self.size:,} ids: these tokens were made by another tokenizer"
            )
        return top

    def _document_ends(self, out: np.ndarray, ids: np.ndarray, ends: np.ndarray, file: TokenFile, at: int):
        """OUT with an EOS after each Megatron document ending here (ENDS: offsets into IDS) that lacks one."""
        missing = ends[ids[ends - 1] != self.eos]
        if missing.size and self.linked:
            raise KHAError(
                f"{file.index.bin}: the document ending at token {at + int(missing[0]):,} does not end with the "
                f"tokenizer's EOS ({self.eos}): documents would run together; pass --copy to insert one after each"
            )
        self.inserted += int(missing.size)
        return (np.insert(out, missing, self.eos) if missing.size else out), int(ends.size)

    def _add(self, ids: np.ndarray, sink, top: int) -> None:
        data = ids.view(np.uint8)  # the file's bytes (ids are little-endian and contiguous)
        self._later(self.digest.update, data)
        self.chunks.update(data)
        if sink is not None:
            sink.write(data)
        self.tokens += ids.size
        self.max_id, self.last = max(self.max_id, top), int(ids[-1])


class _Ends:
    """Megatron document ends (ascending arrays from an iterator), taken up to a token offset at a time."""

    def __init__(self, arrays) -> None:
        self.arrays, self.pending = arrays, np.empty(0, np.int64)

    def upto(self, end: int) -> np.ndarray:
        """The ends at or before END not taken yet."""
        taken = []
        while self.arrays is not None:
            if not self.pending.size:
                self.pending = next(self.arrays, None)
                if self.pending is None:
                    self.arrays, self.pending = None, np.empty(0, np.int64)
                    break
            k = int(np.searchsorted(self.pending, end, side="right"))
            taken.append(self.pending[:k])
            self.pending = self.pending[k:]
            if self.pending.size:
                break
        return np.concatenate(taken) if taken else np.empty(0, np.int64)


def _link(source: Path, dst: Path) -> None:
    """DST as a hard link to SOURCE's file (a named link followed), or a one-line KHAError naming --copy."""
    try:
        os.link(os.path.realpath(source), dst)  # realpath: os.link would link a symbolic link itself
    except OSError as err:
        raise KHAError(
            f"cannot hard-link {source} into {dst.parent.parent} ({err.strerror or err}; a link cannot cross file "
            "systems): pass --copy to write a copy of its tokens instead"
        ) from err


def _open_checked(path: Path, identity: tuple[int, int]) -> int:
    """A read-only descriptor of PATH, which must still be the regular file IDENTITY named (never a FIFO: opened
    without blocking, refused before a byte is read)."""
    try:
        fd = open_regular(path)
    except KHAError:
        raise KHAError(f"{path} was replaced by another file while it was adopted: adopt it again") from None
    info = os.fstat(fd)
    if (info.st_dev, info.st_ino) != identity:
        os.close(fd)
        raise KHAError(f"{path} was replaced by another file while it was adopted: adopt it again")
    return fd


def _index_record(index: MegatronIndex) -> Source:
    """The source record of a Megatron .idx: read once more, in pieces, for its digest (the file checked, unchanged)."""
    idx = index.idx
    digest, source = hashlib.sha256(), Source(str(idx), "file")
    with os.fdopen(open_regular(idx), "rb") as f:
        info = os.fstat(f.fileno())
        if file_stamp(info) != index.stamp:
            raise KHAError(f"{idx} changed while it was read: adopt it again")
        while piece := f.read(READ_BYTES):
            digest.update(piece)
    source.bytes, source.mtime_ns, source.sha256 = info.st_size, info.st_mtime_ns, digest.hexdigest()
    return source
