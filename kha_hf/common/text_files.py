"""Reading user-named text and small JSON files with one-line errors (missing, a folder, binary, not UTF-8)."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import KHAError


def read_text_file(path: str | Path, what: str = "file") -> str:
    """The UTF-8 text of PATH; KHAError for a missing file, a folder or binary content."""
    path = Path(path).expanduser()
    if not path.exists():
        raise KHAError(f"{what} {path}: no such file")
    if not path.is_file():
        raise KHAError(f"{what} {path} is not a file")
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        raise KHAError(f"{what} {path} is binary, not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise KHAError(f"{what} {path} is not UTF-8 text ({err.reason} at byte {err.start})") from err


def read_json_object(path: Path, max_bytes: int = 1 << 20) -> dict:
    """PATH's JSON object (a small settings file: an adapter or generation config); one-line KHAError for a file
    over MAX_BYTES, invalid or nested-too-deep JSON, or anything but an object."""
    if path.stat().st_size > max_bytes:
        raise KHAError(f"{path} is larger than a settings file can be ({path.stat().st_size} bytes)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise KHAError(f"{path} is not valid JSON: {str(err)[:200]}") from None
    if not isinstance(raw, dict):
        raise KHAError(f"{path} must hold a JSON object")
    return raw


def bounded_lines(f, limit: int):
    """The lines of the binary file F, each at most LIMIT bytes: a longer one (a 1 GiB line of a planted record) is
    skipped, read past in pieces of LIMIT, so what is held never grows with the file."""
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        if len(line) <= limit or line.endswith(b"\n"):
            yield line
            continue
        while line and not line.endswith(b"\n"):  # the rest of an overlong line
            line = f.readline(limit)


def keep_rows(path: Path, rows, keep_until: int | None, source: Path | None = None) -> None:
    """Rewrite the JSON-lines record PATH with the ROWS read from SOURCE (default PATH itself; a function of a path,
    yielding dicts) whose step is at most KEEP_UNTIL (None: every one), streamed through a sibling file: a resumed
    run's record without the steps that run again, and nothing but rows copied. Nothing is written when SOURCE is
    not a regular file."""
    import os

    source = path if source is None else source
    if not source.is_file() or source.is_symlink():
        return
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        for row in rows(source):
            if keep_until is None or row["step"] <= keep_until:
                out.write(json.dumps(row, allow_nan=True) + "\n")
    os.replace(tmp, path)
