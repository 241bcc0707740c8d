"""Where the tools may read and write: destination checks, confined file names, free space.

A tool that rewrites other people's multi-GB checkpoints must never delete or overwrite what it was not asked to:
- DST may not be SRC, hold SRC, be the working directory, the home directory or a filesystem root;
- `--overwrite` replaces only a folder that looks like a checkpoint (it has a config.json);
- every file name read from a checkpoint (index shard names) is a plain name inside its folder;
- the space a copy needs is checked before anything is written.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..common.errors import KHAError


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _is_within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_destination(dst: str | Path, sources: list[Path], overwrite: bool) -> Path:
    """The absolute DST, or KHAError when writing (or replacing) it could harm files the user did not name."""
    dst = Path(dst).expanduser().absolute()
    real = _real(dst)
    protected = {
        _real(Path.cwd()): "the current directory",
        _real(Path.home()): "your home directory",
        Path(real.anchor): "a filesystem root",
    }
    if real in protected:
        raise KHAError(f"refusing to write to {dst}: it is {protected[real]}; name a new folder instead")
    for src in sources:
        src_real = _real(src)
        if real == src_real:
            raise KHAError(f"the destination {dst} is the source; name a new folder")
        if _is_within(src_real, real):
            raise KHAError(f"the destination {dst} contains the source {src}; name a folder outside it")
    if dst.exists() or dst.is_symlink():
        if not overwrite:
            raise KHAError(f"{dst} already exists; pass --overwrite to replace it")
        check_replaceable(dst)
    return dst


def check_replaceable(dst: Path) -> None:
    """`--overwrite` removes only folders that look like checkpoints this tool or transformers wrote."""
    if dst.is_symlink() or not dst.is_dir():
        raise KHAError(f"{dst} exists and is not a folder; --overwrite replaces checkpoint folders only")
    if not (dst / "config.json").is_file():
        raise KHAError(
            f"{dst} exists and has no config.json, so it does not look like a checkpoint folder; "
            "--overwrite will not remove it: delete it yourself or name another folder"
        )


def member_path(folder: Path, name: str, what: str = "file") -> Path:
    """FOLDER/NAME for a file name read from a checkpoint (e.g. a shard in model.safetensors.index.json).

    Only plain names are accepted: no absolute path, no separator, no `..`, so nothing outside FOLDER is read
    from or written to. (The file itself may be a symbolic link, as in the Hugging Face cache.)
    """
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
        or os.path.isabs(name)
    ):
        raise KHAError(f"refusing {what} name {name!r} in {folder}: it must be a plain file name inside the folder")
    return folder / name


def check_free_space(folder: Path, needed: int, what: str) -> None:
    """KHAError with both sizes when the file system of FOLDER has less than NEEDED bytes free."""
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise KHAError(f"not enough free space in {folder} for {what}: needs {_size(needed)}, {_size(free)} available")


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"
