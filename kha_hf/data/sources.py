"""Documents from the sources of `kha tokenize`, read as a stream: files and folders (.txt/.md one document per
file, .jsonl one per line's "text", .parquet one per row's "text") or a Hub dataset read with `streaming=True`.

Memory stays flat however large a source is: files are read in pieces of `PIECE_BYTES`, a long text document is
handed on in pieces cut before a space between two words (so its tokens are those of the whole text; text without
spaces is cut at a character boundary), and a JSON line or Parquet value longer than `MAX_JSON_LINE` is skipped.

What cannot become text is counted, never silently dropped (dolma and datatrove count the same way): an empty
document (`empty`), a line that is not UTF-8 (`undecodable`), a JSON line that is not an object with a string
"text" (`no_text`), a JSON line past `MAX_JSON_LINE` (`too_long`). The manifest records the counts and `kha
tokenize` prints them.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.loading import HUB_ID, describe_error
from ..common.errors import KHAError

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".text")
SUFFIXES = (*TEXT_SUFFIXES, ".jsonl", ".parquet")
PIECE_BYTES = 1 << 20  # a text document reaches the tokenizer in pieces of about 1 MiB
MAX_JSON_LINE = 64 << 20  # a JSON line past this is skipped (counted as too_long), not read into memory
SKIP_KINDS = ("empty", "undecodable", "no_text", "too_long")


@dataclass
class Source:
    """One file (or Hub dataset) of the corpus and what reading it found; `sha256` and `bytes` of the file as read."""

    name: str
    kind: str  # "file" or "hub"
    bytes: int = 0
    sha256: str | None = None
    mtime_ns: int | None = None
    documents: int = 0
    skipped: Counter = field(default_factory=Counter)

    def record(self) -> dict:
        out = {"name": self.name, "kind": self.kind, "bytes": self.bytes, "documents": self.documents}
        if self.sha256 is not None:
            out.update(sha256=self.sha256, mtime_ns=self.mtime_ns)
        out["skipped"] = {kind: self.skipped[kind] for kind in SKIP_KINDS if self.skipped[kind]}
        return out


@dataclass
class Piece:
    """Text to tokenize. `ends_document`: the document ends here (an EOS follows)."""

    text: str
    ends_document: bool


def resolve_sources(names: list[str]) -> list[Source]:
    """Sources in order: each named file, each folder's files (sorted, by suffix), or a Hub dataset `owner/name`.

    Refused in one line: nothing named, a missing path that is no Hub id, a FIFO, device or socket (reading one could
    block or never end; inside a folder too), a folder without corpus files, an unsupported file type.
    """
    if not names:
        raise KHAError("name at least one source: a file, a folder or a Hub dataset")
    sources: list[Source] = []
    for name in names:
        if not str(name).strip():
            raise KHAError("an empty source name (a variable that was not set?): name a file, a folder or a dataset")
        path = Path(name).expanduser()
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and not p.is_dir())
            if not files:
                raise KHAError(f"{path} holds no {', '.join(SUFFIXES)} files")
            inside = os.path.realpath(path)
            for p in files:  # as for checkpoints: a folder's link may not reach out of it (`secret.txt -> ~/.netrc`)
                target = os.path.realpath(p)
                if os.path.commonpath([inside, target]) != inside:
                    raise KHAError(
                        f"{p} is a link to {target}, outside the source folder {path}: name that file itself if you "
                        "mean to read it"
                    )
            sources += [_file_source(p) for p in files]
        elif path.exists() or path.is_symlink():
            if path.suffix not in SUFFIXES:
                raise KHAError(f"{path}: unsupported file type (use {', '.join(SUFFIXES)})")
            sources.append(_file_source(path))
        elif looks_like_hub_dataset(name):
            sources.append(Source(name, "hub"))
        else:
            raise KHAError(f"{name}: no such file or folder (and not a Hub dataset of the form owner/name)")
    seen: dict = {}
    for source in sources:  # a file read twice (a link, a hard link) would train on one copy and hold the other out
        info = os.stat(source.name) if source.kind == "file" else None  # links followed: hard links are one file
        key = (info.st_dev, info.st_ino) if info else source.name
        if key in seen:
            raise KHAError(f"{source.name} is named twice among the sources (also as {seen[key]}): name it once")
        seen[key] = source.name
    return sources


def _file_source(path: Path) -> Source:
    try:
        mode = os.stat(path).st_mode  # follows a link: what would be read
    except OSError as err:
        raise KHAError(f"{path}: cannot read it ({err.strerror or err})") from err
    if not stat.S_ISREG(mode):
        raise KHAError(f"{path} is not a regular file (a FIFO, device or socket, or a link to one)")
    return Source(str(path.absolute()), "file")


def looks_like_hub_dataset(name: str) -> bool:
    """`owner/name` (unless `owner` is a local folder) or a bare name without a file suffix."""
    if "/" not in name:
        return not Path(name).suffix
    return bool(HUB_ID.match(name)) and not Path(name.split("/", 1)[0]).is_dir()


def read_pieces(source: Source, hub_split: str = "train", column: str = "text") -> Iterator[Piece]:
    """The pieces of SOURCE's documents, in order; fills in its size, hash and counts as it reads."""
    if source.kind == "hub":
        yield from _hub_pieces(source, hub_split, column)
        return
    path = Path(source.name)
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            before = os.fstat(f.fileno()).st_mtime_ns
            if path.suffix == ".parquet":
                yield from _parquet_pieces(f, source, digest, column)
            else:
                chunks = _hashed_chunks(f, source, digest)
                reader = _jsonl_pieces if path.suffix == ".jsonl" else _text_pieces
                yield from reader(chunks, source)
            # the record is the file as read: its time once read (a file appended to while it was read recorded the
            # time at open beside the bytes read, and every later --data refused it as changed, #70 item 13)
            after = os.fstat(f.fileno())
            source.mtime_ns = after.st_mtime_ns
            if after.st_mtime_ns != before and path.suffix != ".parquet":
                print(f"{path} changed while it was read: the corpus holds the {source.bytes:,} bytes read")
    except OSError as err:
        raise KHAError(f"cannot read {path}: {err.strerror or err}") from err
    source.sha256 = digest.hexdigest()


def _hashed_chunks(f, source: Source, digest) -> Iterator[bytes]:
    while chunk := f.read(PIECE_BYTES):
        digest.update(chunk)
        source.bytes += len(chunk)
        yield chunk


def _decode_lines(data: bytes, source: Source) -> str:
    """DATA as text; a line that is not UTF-8 is dropped and counted (`undecodable`)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        kept = []
        for line in data.splitlines(keepends=True):
            try:
                kept.append(line.decode("utf-8"))
            except UnicodeDecodeError:
                source.skipped["undecodable"] += 1
        return "".join(kept)


def _word_start(data: bytes | str, start: int = 0, end: int | None = None) -> int:
    """The last position in DATA[start:end] of a single space between two letters or digits ("word| next"), or 0
    when there is none. Cut there, the pre-tokenizers of byte-level BPE (GPT-2's, Llama 3's, Qwen's splits) and
    SentencePiece's metaspace make the same pieces on both sides as in the whole text: the space opens the next
    word's piece in all of them, and no run of whitespace or punctuation is split."""
    end = len(data) if end is None else end
    space = " " if isinstance(data, str) else b" "
    at = data.rfind(space, start + 1, end - 1)
    while at > start:
        if data[at - 1 : at].isalnum() and data[at + 1 : at + 2].isalnum():
            return at
        at = data.rfind(space, start + 1, at)
    return 0


def _text_pieces(chunks: Iterator[bytes], source: Source) -> Iterator[Piece]:
    """One document per file, in pieces cut before a space between two words (`_word_start`); a piece without one
    (Chinese or Japanese text, a base64 blob) is cut at a character boundary, the only cut that may change a token.
    A piece is never much longer than PIECE_BYTES: a tokenizer holds tens of bytes a token while it encodes."""
    carry, pending, produced = b"", "", False
    for chunk in chunks:
        data = carry + chunk
        cut = _word_start(data)
        if cut == 0 and len(data) >= PIECE_BYTES:  # no word boundary in a piece (CJK, base64): cut before a character
            cut = len(data) - 1
            while cut > 0 and (data[cut] & 0xC0) == 0x80:  # a UTF-8 continuation byte: not a character's start
                cut -= 1
            cut = cut or len(data)
        carry, data = data[cut:], data[:cut]
        pending += _decode_lines(data, source)
        # whitespace is held back until text follows (a file of blank lines is an empty document, not one)
        if pending and (produced or pending.strip() or len(pending) > 4 * PIECE_BYTES):
            produced = True
            yield Piece(pending, False)
            pending = ""
    pending += _decode_lines(carry, source)
    if produced or pending.strip():
        yield Piece(pending, True)
        source.documents += 1
    else:
        source.skipped["empty"] += 1


def _jsonl_pieces(chunks: Iterator[bytes], source: Source) -> Iterator[Piece]:
    """One document per JSON line's "text"; a line past MAX_JSON_LINE is skipped while it streams past."""
    line, skipping = bytearray(), False
    for chunk in chunks:
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            part = chunk[start:] if end < 0 else chunk[start:end]
            if not skipping:
                line += part
                if len(line) > MAX_JSON_LINE:
                    line, skipping = bytearray(), True
                    source.skipped["too_long"] += 1
            if end < 0:
                break
            if not skipping:
                yield from _json_document(bytes(line), source)
            line, skipping, start = bytearray(), False, end + 1
    if line and not skipping:
        yield from _json_document(bytes(line), source)


def _json_document(line: bytes, source: Source) -> Iterator[Piece]:
    if not line.strip():
        return  # a blank line between records is no document
    try:
        text = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        source.skipped["undecodable"] += 1
        return
    except (json.JSONDecodeError, RecursionError):
        source.skipped["no_text"] += 1
        return
    yield from _document(text.get("text") if isinstance(text, dict) else None, source)


def _document(text, source: Source) -> Iterator[Piece]:
    """TEXT (a JSON line's, Parquet row's or Hub row's "text") as one document, or counted as skipped."""
    if not isinstance(text, str):
        source.skipped["no_text"] += 1
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # JSON's "\ud800": a lone surrogate, no text a tokenizer takes
        source.skipped["undecodable"] += 1
        return
    if not text.strip():
        source.skipped["empty"] += 1
        return
    source.documents += 1
    if source.kind == "hub":  # a file's bytes are counted as it is read
        source.bytes += len(text.encode("utf-8"))
    yield from _split_document(text)


def _split_document(text: str) -> Iterator[Piece]:
    """A long document in pieces of about PIECE_BYTES characters, cut before a space between two words if any."""
    start = 0
    while len(text) - start > PIECE_BYTES:
        cut = _word_start(text, start, start + PIECE_BYTES) or start + PIECE_BYTES
        yield Piece(text[start:cut], False)
        start = cut
    yield Piece(text[start:], True)


def _parquet_pieces(f, source: Source, digest, column: str) -> Iterator[Piece]:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(f)
        if column not in table.schema_arrow.names:
            raise KHAError(f"{source.name}: no {column!r} column (columns: {', '.join(table.schema_arrow.names)})")
        for batch in table.iter_batches(batch_size=16, columns=[column]):
            values = batch.column(0)
            if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
                source.skipped["no_text"] += len(values)
                continue
            lengths = pc.binary_length(values).to_pylist()
            for i, length in enumerate(lengths):  # a value's Python copy is made only for one that fits
                if length is None:
                    source.skipped["no_text"] += 1
                elif length > MAX_JSON_LINE:
                    source.skipped["too_long"] += 1
                else:
                    yield from _document(values[i].as_py(), source)
    except KHAError:
        raise
    except Exception as err:  # pyarrow's errors (ArrowInvalid, ...) share no base class with OSError
        raise KHAError(f"{source.name} is not a readable Parquet file: {describe_error(err)}") from err
    f.seek(0)  # the hash covers the whole file, read once more in pieces (Parquet is read by column chunks)
    for _ in _hashed_chunks(f, source, digest):
        pass


def _hub_pieces(source: Source, split: str, column: str) -> Iterator[Piece]:
    try:
        import datasets

        rows = datasets.load_dataset(source.name, split=split, streaming=True)
    except Exception as err:
        raise KHAError(
            f"cannot stream dataset {source.name!r} from the Hugging Face Hub: {describe_error(err)}"
        ) from err
    for row in rows:
        yield from _document(row.get(column) if isinstance(row, dict) else None, source)
