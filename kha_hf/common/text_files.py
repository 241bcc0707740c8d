"""Reading user-named text files with one-line errors (missing, a folder, binary, not UTF-8)."""

from __future__ import annotations

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
