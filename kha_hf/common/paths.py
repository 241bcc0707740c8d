"""Where the tools may read and write: destination checks, confined file names, free space.

A tool that rewrites other people's multi-GB checkpoints must never delete or overwrite what it was not asked to:
- DST may not be SRC, hold SRC, be the working directory, the home directory or a filesystem root, and may not lie
  inside a data folder the tool reads (a later run would read its own output as data);
- `--overwrite` replaces only a folder that a tool wrote: a checkpoint (config.json), a training run
  (checkpoint-N/ folders) or a kha results folder (its `.kha-output` marker);
- every file name read from a checkpoint (index shard names) is a plain name inside its folder;
- the space a copy needs is checked before anything is written.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .errors import KHAError


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _is_within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


OUTPUT_MARKER = ".kha-output"  # in every results folder of kha ab / demo / eval: what --overwrite may replace


def check_destination(dst: str | Path, sources: list[Path], overwrite: bool, data_folders: list[Path] = ()) -> Path:
    """The absolute DST, or KHAError when writing (or replacing) it could harm files the user did not name.

    SOURCES are read (DST may not be one or hold one); DATA_FOLDERS are read recursively (DST may not lie in one).
    """
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
    for folder in data_folders:
        if _is_within(real, _real(folder)):
            raise KHAError(
                f"the destination {dst} is inside the data folder {folder}: a later run would read it as training "
                "data; name a folder outside it"
            )
    if dst.exists() or dst.is_symlink():
        if not overwrite:
            raise KHAError(f"{dst} already exists; pass --overwrite (overwrite=True from Python) to replace it")
        check_replaceable(dst)
    check_writable(dst)
    return dst


def check_writable(dst: Path) -> None:
    """KHAError unless a folder can be created next to DST (in its nearest existing ancestor), before any model is
    loaded. The probe asks the filesystem itself (permissions, read-only mounts, root's rights) and leaves nothing."""
    import tempfile

    ancestor = dst.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".probe", dir=ancestor))
    except OSError as err:
        raise KHAError(f"cannot write next to {dst}: {err.strerror or err}") from err


def check_run_destination(dst: str | Path, models: list, data: list | None, overwrite: bool) -> Path:
    """`check_destination` for a tool that reads MODELS (paths or Hub ids; None is skipped) and DATA (files or
    folders; DST may lie in neither)."""
    data_paths = [Path(str(d)).expanduser() for d in data or []]
    model_paths = [Path(str(m)).expanduser() for m in models if m is not None]
    sources = [path for path in (*model_paths, *data_paths) if path.exists()]
    return check_destination(dst, sources, overwrite, [path for path in data_paths if path.is_dir()])


def is_training_run(folder: Path) -> bool:
    """True for a folder holding transformers Trainer checkpoints (checkpoint-N/trainer_state.json)."""
    return any(path.is_file() for path in folder.glob("checkpoint-*/trainer_state.json"))


def check_replaceable(dst: Path) -> None:
    """`--overwrite` removes only folders this tool or transformers wrote: a checkpoint, a training run or a kha
    results folder; and only folders it can remove completely."""
    if dst.is_symlink() or not dst.is_dir():
        raise KHAError(f"{dst} exists and is not a folder; --overwrite replaces checkpoint folders only")
    if not ((dst / "config.json").is_file() or (dst / OUTPUT_MARKER).is_file() or is_training_run(dst)):
        raise KHAError(
            f"{dst} exists and has no config.json, checkpoints or kha results, so it does not look like a folder kha "
            "wrote; --overwrite will not remove it: delete it yourself or name another folder"
        )
    if not os.access(dst, os.W_OK | os.X_OK) or not os.access(dst.parent, os.W_OK | os.X_OK):
        raise KHAError(f"{dst} cannot be replaced: no permission to remove it (or to write in {dst.parent})")


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
