"""`kha tokenize`: read sources as a stream, tokenize them on every core, and write a prepared corpus (corpus.py).

Documents are joined with EOS (as `training.data.pack` joins them); BOS is not stored: where the tokenizer leads
every encoding with it, each block gets it at training time, as `pack` does. Worker processes (one a core by
default) each load the tokenizer once and encode batches of text pieces; at most two batches a worker are in
flight, so memory stays flat however large the corpus. The corpus is written into a temporary sibling folder that
becomes the output only once the manifest is written: an interrupted or failed run never leaves a folder that
looks complete.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import multiprocessing
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from ..checkpoint.output import atomic_output_dir, check_free_space
from ..checkpoint.paths import check_run_destination
from ..common.errors import KHAError
from ..common.version import __version__
from .chunks import CHUNK_BYTES, CHUNKS, ChunkHasher
from .corpus import FORMAT, MANIFEST, SPLITS, TOKENIZER_DIR, TOKENS, VERSION
from .fingerprint import tokenizer_fingerprint
from .sources import SKIP_KINDS, Piece, Source, read_pieces, resolve_sources

BATCH_CHARS = 1 << 20  # text a worker encodes in one call: at most ~1 M tokens, ~200 MB of tokenizer state
DEFAULT_EVAL_FRACTION = 0.05  # = training.data's held-out and validation fractions
DEFAULT_MAX_EVAL_TOKENS = 1 << 24  # each evaluation split holds at most this many tokens (16.8 M)

_worker_tokenizer = None


def _start_worker(tokenizer_dir: str) -> None:
    global _worker_tokenizer
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread a worker: the workers are the parallelism
    from transformers import AutoTokenizer

    _worker_tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=False)


class IdPastTheDtype(ValueError):
    """A token id the corpus's dtype cannot hold: the tokenizer gave an id past the size it states."""


def _encode(texts: list[str], dtype_name: str) -> list[np.ndarray]:
    ids = _worker_tokenizer(texts, add_special_tokens=False)["input_ids"]
    rows = [np.asarray(row, dtype=np.int64) for row in ids]
    limit = np.iinfo(dtype_name).max
    for row in rows:
        if row.size and (row.max() > limit or row.min() < 0):
            raise IdPastTheDtype(
                f"the tokenizer gave token id {int(row.max())}, past the {dtype_name} this corpus "
                f"was sized for from the tokenizer's own size"
            )
    return [row.astype(dtype_name) for row in rows]


class _InProcess:
    """One worker: encode in this process (no worker start-up), with the pool's interface."""

    def __init__(self, tokenizer_dir: str) -> None:
        _start_worker(tokenizer_dir)

    def apply_async(self, fn, args):
        return SimpleNamespace(get=lambda: fn(*args))  # run by get(), which raises what FN raises, as a pool's does


def _pool(workers: int, tokenizer_dir: str):
    if workers == 1:
        return contextlib.nullcontext(_InProcess(tokenizer_dir))
    context = multiprocessing.get_context("spawn")  # never fork a process that may hold threads (tokenizers, torch)
    return context.Pool(workers, _start_worker, (tokenizer_dir,))


def _batches(sources: list[Source], hub_split: str) -> Iterator[list[Piece]]:
    batch, chars = [], 0
    for source in sources:
        for piece in read_pieces(source, hub_split):
            batch.append(piece)
            chars += len(piece.text)
            if chars >= BATCH_CHARS:
                yield batch
                batch, chars = [], 0
    if batch:
        yield batch


def tokenize_corpus(
    sources: list[str],
    tokenizer: str | Path,
    output: str | Path,
    workers: int | None = None,
    eval_fraction: float = DEFAULT_EVAL_FRACTION,
    max_eval_tokens: int = DEFAULT_MAX_EVAL_TOKENS,
    hub_split: str = "train",
    overwrite: bool = False,
    disable_tqdm: bool = False,
) -> dict:
    """Tokenize SOURCES with TOKENIZER (a name or folder) into the new folder OUTPUT; returns the manifest.

    The stream's last EVAL_FRACTION (at most MAX_EVAL_TOKENS) is held out and the same amount before it is the
    validation split; the rest trains.
    """
    check_eval_options(eval_fraction, max_eval_tokens)
    workers = workers or max(1, os.cpu_count() or 1)
    resolved = resolve_sources(list(sources))
    local = [s.name for s in resolved if s.kind == "file"]
    named = [name for name in sources if Path(name).expanduser().exists()]  # the output may lie in none of them
    final = check_run_destination(output, [tokenizer], named + local, overwrite)
    tok, size = load_corpus_tokenizer(tokenizer)
    dtype_name = corpus_dtype(size)
    source_bytes = sum(os.path.getsize(name) for name in local)
    # about 4 bytes of text a token at the least: refuse a disk that cannot hold the tokens before reading anything
    check_free_space(final.parent, source_bytes * np.dtype(dtype_name).itemsize // 4, "the tokenized corpus")

    with atomic_output_dir(final, overwrite=overwrite, marker="corpus") as out:
        save_corpus_tokenizer(tok, out, final)
        started = time.perf_counter()
        written, max_id, digest, chunks = _write_tokens(
            resolved, out, tok.eos_token_id, dtype_name, workers, hub_split, disable_tqdm
        )
        seconds = time.perf_counter() - started
        stream = CorpusStream(dtype_name, written, digest, chunks, max_id, sum(s.documents for s in resolved))
        manifest = corpus_manifest(tok, str(tokenizer), stream, eval_fraction, max_eval_tokens)
        manifest["skipped"] = {kind: sum(s.skipped[kind] for s in resolved) for kind in SKIP_KINDS}
        manifest["sources"] = [s.record() for s in resolved]
        write_manifest(out, manifest)
    report_corpus(manifest, final)
    rate = f"{written / seconds:,.0f}"
    print(f"tokenized at {rate} tokens/s with {workers} worker(s) ({seconds:.1f} s, their start included)")
    return manifest


@dataclass(frozen=True)
class CorpusStream:
    """What a corpus's tokens.bin holds, as its writer measured it (the manifest's token fields)."""

    dtype: str  # "uint16" or "uint32"
    tokens: int
    sha256: str  # of tokens.bin
    chunks_sha256: str  # of tokens.chunks
    max_token_id: int
    documents: int


def check_eval_options(eval_fraction: float, max_eval_tokens: int) -> None:
    """One-line refusal of an evaluation fraction or token cap the split rule cannot use."""
    if not 0 < eval_fraction < 0.5:
        raise KHAError(f"the evaluation fraction must be between 0 and 0.5, got {eval_fraction}")
    if not isinstance(max_eval_tokens, int) or max_eval_tokens < 1:
        raise KHAError(f"the evaluation splits' token cap must be a positive integer, got {max_eval_tokens!r}")


def load_corpus_tokenizer(tokenizer: str | Path):
    """(the tokenizer TOKENIZER names, the number of ids it can give): its length, or its vocabulary's largest id
    + 1 where that is more (a tokenizer.json may state fewer). One line when it has no EOS."""
    from ..checkpoint.loading import load_tokenizer

    gguf = Path(tokenizer).expanduser() if str(tokenizer).endswith(".gguf") else None
    tok = load_tokenizer(gguf or tokenizer, None, gguf=gguf, offer_trust=False, offer_tokenizer=False)
    if tok.eos_token_id is None:
        raise KHAError(f"the tokenizer {tokenizer} has no EOS token: documents could not be told apart")
    return tok, max(len(tok), max(tok.get_vocab().values(), default=0) + 1)


def corpus_dtype(size: int) -> str:
    """The token file's dtype for a tokenizer of SIZE ids: 2 bytes a token where they fit."""
    return "uint16" if size <= 1 << 16 else "uint32"


def save_corpus_tokenizer(tok, out: Path, final: Path) -> None:
    try:
        tok.save_pretrained(out / TOKENIZER_DIR)
    except Exception as err:  # tokenizers' Rust writer raises a bare Exception ("File too large (os error 27)")
        raise KHAError(f"cannot write the tokenizer into {final}: {err}") from err


def corpus_manifest(tok, name: str, stream: CorpusStream, eval_fraction: float, max_eval_tokens: int) -> dict:
    """The manifest of a corpus holding STREAM, without its skipped and sources records (the caller's): the
    stream's last EVAL_FRACTION (at most MAX_EVAL_TOKENS) held out, the same before it for validation."""
    written = stream.tokens
    n_eval = min(max_eval_tokens, int(written * eval_fraction))
    if n_eval < 1 or written - 2 * n_eval < 1:
        raise KHAError(f"the sources hold {written} tokens: too few for a validation and a held-out split")
    bounds = [0, written - 2 * n_eval, written - n_eval, written]
    return {
        "format": FORMAT,
        "version": VERSION,
        "kha_hf_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "tokenizer": tokenizer_fingerprint(tok, name),
        "dtype": stream.dtype,
        "tokens": written,
        "tokens_sha256": stream.sha256,
        "chunk_bytes": CHUNK_BYTES,  # tokens.chunks: a digest a chunk, checked as blocks are read (data/chunks.py)
        "chunks_sha256": stream.chunks_sha256,
        "max_token_id": stream.max_token_id,
        "documents": stream.documents,
        "splits": {name: [bounds[i], bounds[i + 1]] for i, name in enumerate(SPLITS)},
        "split_rule": f"the stream's last {eval_fraction:g} (at most {max_eval_tokens} tokens) held out, the "
        "same before it for validation, in source order",
    }


def write_manifest(out: Path, manifest: dict) -> None:
    """The manifest, written last: a folder without one is no corpus (`open_corpus`)."""
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")


def write_chunk_digests(out: Path, digests: bytes) -> str:
    """OUT/tokens.chunks holding DIGESTS (ChunkHasher.finish), synced; returns its sha256 for the manifest."""
    with open(out / CHUNKS, "wb") as f:
        f.write(digests)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(digests).hexdigest()


def _write_tokens(
    sources: list[Source], out: Path, eos: int, dtype_name: str, workers: int, hub_split: str, disable_tqdm: bool
) -> tuple[int, int, str, str]:
    """Tokenize into OUT/tokens.bin and its chunks' digests into OUT/tokens.chunks; returns (tokens written, largest
    id, sha256 of the file, sha256 of tokens.chunks)."""
    from tqdm.auto import tqdm

    eos_array = np.asarray([eos], dtype=dtype_name)
    digest, chunks, written, max_id = hashlib.sha256(), ChunkHasher(), 0, -1
    bar = tqdm(desc="tokenizing", unit=" tok", unit_scale=True, disable=disable_tqdm, smoothing=0.1)
    try:
        with open(out / TOKENS, "wb") as f, _pool(workers, str(out / TOKENIZER_DIR)) as pool:
            pending: collections.deque = collections.deque()

            def drain_one() -> None:
                nonlocal written, max_id
                pieces, result = pending.popleft()
                try:
                    encoded = result.get()
                except IdPastTheDtype as err:
                    raise KHAError(f"{err}: a tokenizer that lies about its vocabulary") from None
                for piece, ids in zip(pieces, encoded, strict=True):
                    for part in (ids, eos_array) if piece.ends_document else (ids,):
                        if part.size:
                            f.write(part.tobytes())
                            digest.update(part.tobytes())
                            chunks.update(part.tobytes())
                            written += part.size
                            max_id = max(max_id, int(part.max()))
                            bar.update(part.size)

            for batch in _batches(sources, hub_split):
                pending.append((batch, pool.apply_async(_encode, ([p.text for p in batch], dtype_name))))
                while len(pending) >= 2 * workers:  # bounded: reading never runs far ahead of the workers
                    drain_one()
            while pending:
                drain_one()
            f.flush()
            os.fsync(f.fileno())
        chunks_sha256 = write_chunk_digests(out, chunks.finish())
    except OSError as err:
        raise KHAError(f"cannot write the corpus to {out.parent}: {err.strerror or err}") from err
    finally:
        bar.close()
    if written == 0:
        raise KHAError("the sources hold no text to tokenize")
    return written, max_id, digest.hexdigest(), chunks_sha256


def report_corpus(manifest: dict, final: Path) -> None:
    """The one line that says what a corpus folder FINAL holds."""
    skipped = {k: v for k, v in manifest["skipped"].items() if v}
    note = f"; skipped: {', '.join(f'{v} {k}' for k, v in skipped.items())}" if skipped else ""
    splits = ", ".join(f"{name} {end - start:,}" for name, (start, end) in manifest["splits"].items())
    print(
        f"wrote {final}: {manifest['tokens']:,} tokens ({manifest['dtype']}) from {manifest['documents']:,} "
        f"documents in {len(manifest['sources'])} source(s); {splits} tokens{note}"
    )
