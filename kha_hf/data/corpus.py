"""A prepared corpus: one flat file of token ids and a JSON manifest (the layout nanoGPT and OLMo-core use).

    DIR/
      manifest.json   what the tokens are: tokenizer fingerprint, dtype, token count, splits, sources, skips
      tokens.bin      every token id, native little-endian uint16 (vocabularies up to 65,536) or uint32
      tokenizer/      the tokenizer that wrote them (`kha ab --data DIR` trains a model for it)

Why this format: 2 bytes a token (4 past 65,536), random access to any block by one `pread`, nothing to install,
readable with `numpy.memmap`. HF `datasets` Arrow would hold one list of ids per document (offsets, row groups) and
still need packing into blocks at every step; litdata and MosaicML streaming add a dependency and a chunk format for
object stores that a local run does not need.

The splits are token ranges of `tokens.bin`, set at preparation: the stream's tail is held out (reported loss),
the range before it is the validation split (choices such as learning rates), the rest trains. Blocks are cut at
training time for the run's `--seq-len`, within a split, so no block crosses from one split into another.

A reader never maps the file: each block is read with `os.pread` into a fresh buffer, so what a process holds does
not grow with the corpus or with the steps it has trained (pages it touched stay in the kernel's page cache, which
is not the process's memory).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ..common.errors import KHAError
from .chunks import ChunkCheck, read_chunk_digests
from .fingerprint import fingerprint_difference, tokenizer_fingerprint

FORMAT = "kha-corpus"
VERSION = 1
MANIFEST, TOKENS, TOKENIZER_DIR = "manifest.json", "tokens.bin", "tokenizer"
SPLITS = ("train", "validation", "heldout")
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
MAX_MANIFEST_BYTES = 64 << 20  # a manifest lists sources; one of this size is not one kha wrote


def is_prepared_corpus(path: str | Path) -> bool:
    """A folder holding a manifest.json: `--data DIR` then means a prepared corpus, not a folder of text files."""
    path = Path(path).expanduser()
    return path.is_dir() and (path / MANIFEST).is_file()


@dataclass(frozen=True)
class PreparedCorpus:
    """An opened, checked corpus folder: its manifest and where each split lies in `tokens.bin`."""

    folder: Path
    manifest: dict
    dtype: np.dtype
    splits: dict[str, tuple[int, int]]  # split -> (first token, end token)
    manifest_sha256: str  # of the manifest's bytes as read: what a resumed run checks it trains on
    chunks: tuple[int, bytes] | None = None  # (chunk bytes, digests) of tokens.chunks (data/chunks.py); None: older

    @property
    def tokens(self) -> int:
        return self.manifest["tokens"]

    def check_tokenizer(self, tokenizer, what: str = "the model's tokenizer") -> None:
        """One-line refusal when TOKENIZER is not the one that prepared the corpus."""
        recorded = self.manifest["tokenizer"]
        if difference := fingerprint_difference(recorded, tokenizer_fingerprint(tokenizer)):
            raise KHAError(
                f"{self.folder} was prepared with another tokenizer than {what} ({difference}; prepared with "
                f"{recorded.get('name')!r}): prepare it again with kha tokenize --tokenizer naming the model"
            )

    def check_sources_unchanged(self) -> None:
        """One-line refusal when a source file that still exists differs in size or time from when it was read:
        the corpus no longer says what the sources say. A source that is gone is fine: the corpus holds its text."""
        for source in self.manifest["sources"]:
            if source.get("kind") != "file" or source.get("mtime_ns") is None:
                continue
            try:
                st = os.stat(source["name"])
            except OSError:
                continue
            if st.st_size != source["bytes"] or st.st_mtime_ns != source["mtime_ns"]:
                raise KHAError(
                    f"{source['name']} changed since {self.folder} was prepared (size or modification time): "
                    "prepare the corpus again with kha tokenize"
                )

    def blocks(self, split: str, seq_len: int, max_blocks: int | None = None) -> TokenBlockFile:
        """SPLIT cut into blocks of SEQ_LEN tokens (BOS + SEQ_LEN - 1 of the stream where the tokenizer leads with
        BOS, as `training.data.pack` does); the tail shorter than a block is dropped."""
        bos = self.manifest["tokenizer"].get("leading_bos")
        body = seq_len - (bos is not None)
        if body < 1:
            raise KHAError(f"a block of {seq_len} token(s) leaves no room beside the tokenizer's BOS token")
        start, end = self.splits[split]
        n = (end - start) // body
        if max_blocks is not None:
            n = min(n, max_blocks)
        return TokenBlockFile(self.folder / TOKENS, self.dtype, start, body, n, bos, self.chunks)


def open_corpus(folder: str | Path) -> PreparedCorpus:
    """Open a prepared corpus; every refusal is one line (not a corpus, an unfinished one, a manifest that lies)."""
    folder = Path(folder).expanduser().absolute()
    path = folder / MANIFEST
    if not path.is_file():
        raise KHAError(f"{folder} is not a prepared corpus (no {MANIFEST}): make one with kha tokenize")
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise KHAError(f"{path} is larger than {MAX_MANIFEST_BYTES >> 20} MiB: not a manifest kha tokenize wrote")
    raw = path.read_bytes()  # read once: parsed and hashed from the same bytes
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise KHAError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise KHAError(f'{path} is not a kha corpus manifest (no "format": "{FORMAT}")')
    if manifest.get("version") != VERSION:
        raise KHAError(f"{path} has format version {manifest.get('version')!r}; this kha-hf reads version {VERSION}")
    dtype_name, tokens = manifest.get("dtype"), manifest.get("tokens")
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise KHAError(f"{path}: dtype {dtype_name!r} is not one of {', '.join(DTYPES)}")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise KHAError(f"{path}: tokens must be a positive integer, got {tokens!r}")
    dtype = np.dtype(DTYPES[dtype_name]).newbyteorder("<")
    if (folder / TOKENS).is_symlink():  # kha tokenize writes a file: a link would read tokens from elsewhere
        raise KHAError(f"{folder / TOKENS} is a symbolic link, not the token file kha tokenize wrote")
    size = (folder / TOKENS).stat().st_size if (folder / TOKENS).is_file() else None
    if size != tokens * dtype.itemsize:
        raise KHAError(
            f"{folder / TOKENS} holds {size if size is not None else 'no'} bytes, not the {tokens} x "
            f"{dtype.itemsize} the manifest says: the corpus is damaged or unfinished; prepare it again"
        )
    splits = _checked_splits(path, manifest.get("splits"), tokens)
    _check_records(path, manifest)
    chunks = read_chunk_digests(folder, manifest, size)
    return PreparedCorpus(folder, manifest, dtype, splits, hashlib.sha256(raw).hexdigest(), chunks)


def _is_int(value) -> bool:
    return type(value) is int


def _check_records(path: Path, manifest: dict) -> None:
    """The tokenizer, sources and largest id are what kha tokenize writes, or a one-line refusal."""
    tokenizer, sources = manifest.get("tokenizer"), manifest.get("sources")
    if not isinstance(tokenizer, dict) or not isinstance(sources, list):
        raise KHAError(f"{path} lacks its tokenizer or sources record: not a manifest kha tokenize wrote")
    if not _is_int(tokenizer.get("size")) or not (
        tokenizer.get("leading_bos") is None or _is_int(tokenizer["leading_bos"])
    ):
        raise KHAError(f"{path}: the tokenizer record's size or leading_bos is not an integer")
    if not _is_int(manifest.get("max_token_id")) or manifest["max_token_id"] < 0:
        raise KHAError(f"{path}: max_token_id must be a non-negative integer, got {manifest.get('max_token_id')!r}")
    for source in sources:
        ok = (
            isinstance(source, dict)
            and isinstance(source.get("name"), str)
            and source.get("kind") in ("file", "hub")
            and _is_int(source.get("bytes"))
            and (source.get("mtime_ns") is None or _is_int(source["mtime_ns"]))
        )
        if not ok:
            raise KHAError(f"{path}: a source record is not what kha tokenize writes: {str(source)[:80]}")


def _checked_splits(path: Path, splits, tokens: int) -> dict[str, tuple[int, int]]:
    if not isinstance(splits, dict) or set(splits) != set(SPLITS):
        raise KHAError(f"{path}: splits must name exactly {', '.join(SPLITS)}")
    out, at = {}, 0
    for name in SPLITS:  # contiguous, in order, covering the file: no token in two splits
        span = splits[name]
        ok = isinstance(span, list) and len(span) == 2 and all(type(v) is int for v in span)
        if not ok or span[0] != at or span[1] < span[0]:
            raise KHAError(f"{path}: split {name} {span!r} is not [start, end] following the previous split")
        out[name], at = (span[0], span[1]), span[1]
    if at != tokens:
        raise KHAError(f"{path}: the splits end at token {at}, not at the {tokens} tokens the corpus holds")
    return out


class TokenBlockFile(Dataset):
    """Fixed-length blocks of a split, read lazily; item i is {"input_ids", "labels"} (both the block, (seq_len,)
    int64). Each read is one `os.pread` (and, the first time a block of a chunk is read, that chunk once more, to check
    its digest: data/chunks.py); the file is opened once per process (a fork reopens it)."""

    def __init__(
        self, path: Path, dtype: np.dtype, start: int, body: int, n: int, bos: int | None, chunks=None
    ) -> None:
        self.path, self.dtype, self.start, self.body, self.n, self.bos = path, dtype, start, body, n, bos
        self.chunks = None if chunks is None else ChunkCheck(*chunks)  # each chunk checked at its first read
        self.id_limit: int | None = None  # the model's vocabulary: an id at or past it is refused, not looked up
        self._fd: int | None = None
        self._pid: int | None = None

    def __len__(self) -> int:
        return self.n

    def __getstate__(self) -> dict:  # a DataLoader worker opens its own descriptor
        return {**self.__dict__, "_fd": None, "_pid": None}

    def _descriptor(self) -> int:
        if self._fd is None or self._pid != os.getpid():
            self._fd, self._pid = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)), os.getpid()
        return self._fd

    def read(self, i: int) -> torch.Tensor:
        """Block I as (seq_len,) int64."""
        if not 0 <= i < self.n:
            raise IndexError(f"block {i} of {self.n}")
        size, offset = self.body * self.dtype.itemsize, (self.start + i * self.body) * self.dtype.itemsize
        if self.chunks is not None:
            self.chunks.check(self._descriptor(), self.path, offset, size)
        data = os.pread(self._descriptor(), size, offset)
        if len(data) != size:
            raise KHAError(f"{self.path} is shorter than its manifest says (block {i}): the corpus changed")
        ids = np.frombuffer(data, dtype=self.dtype)
        if self.id_limit is not None and int(ids.max()) >= self.id_limit:  # the manifest's max_token_id lied
            raise KHAError(
                f"{self.path} holds token id {int(ids.max())} (block {i}), past the model's vocabulary of "
                f"{self.id_limit}: the corpus is not what its manifest says; prepare it again"
            )
        ids = torch.from_numpy(ids.astype(np.int64))
        if self.bos is not None:
            ids = torch.cat([torch.tensor([self.bos]), ids])
        return ids

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        block = self.read(i)
        return {"input_ids": block, "labels": block}

    def __del__(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            with contextlib.suppress(OSError):
                os.close(self._fd)
