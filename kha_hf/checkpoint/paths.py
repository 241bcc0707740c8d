"""Where the tools may read and write: destination checks, confined file names, free space.

A tool that rewrites other people's multi-GB checkpoints must never delete or overwrite what it was not asked to:
- DST may not be SRC, hold SRC, lie inside SRC, be the working directory, the home directory or a filesystem root,
  and may not lie inside a data folder the tool reads (a later run would read its own output as data);
- `--overwrite` replaces only a folder that kha wrote: every folder kha writes carries a `.kha-output` marker, and
  a folder without one (a checkpoint saved by other tools, any folder with a config.json) is never removed;
- a symbolic link in a source folder is followed only to a file inside that folder (or, in a Hugging Face cache
  snapshot, to the repository's blobs): a link out of it is refused with its name, so nothing outside the source is
  copied into an output (or uploaded);
- every file name read from a checkpoint (index shard names) is a plain name inside its folder;
- the space a copy needs is checked before anything is written.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..common.errors import KHAError


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _is_within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


# In every folder kha writes (convert, fold, train, ab, demo, eval): the only folders --overwrite may replace.
OUTPUT_MARKER = ".kha-output"
PARTIAL_MARKER = ".kha-partial"  # in each temporary folder of a run (checkpoint.output): its destination and owner


def check_place(dst: str | Path, sources: list[Path], data_folders: list[Path] = ()) -> Path:
    """The absolute DST, or KHAError when DST is the working directory, home, a filesystem root, a source, holds a
    source, lies inside one, or lies inside a data folder: the part of `check_destination` that does not depend on
    what is at DST (also what a kept `--resume` folder must pass)."""
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
    for src in sources:  # SRC is read-only: not even a new folder inside it (also through a symbolic link)
        if _is_within(real, _real(src)):
            raise KHAError(f"the destination {dst} is inside the source {src}; name a folder outside it")
    return dst


def check_destination(dst: str | Path, sources: list[Path], overwrite: bool, data_folders: list[Path] = ()) -> Path:
    """The absolute DST, or KHAError when writing (or replacing) it could harm files the user did not name.

    SOURCES are read (DST may not be one, hold one or lie inside one); DATA_FOLDERS are read recursively (DST may not
    lie in one).
    """
    dst = check_place(dst, sources, data_folders)
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
        os.rmdir(tempfile.mkdtemp(prefix=".kha-", suffix=".probe", dir=ancestor))  # short: any valid DST name
    except OSError as err:
        raise KHAError(f"cannot write next to {dst}: {err.strerror or err}") from err


def check_run_destination(dst: str | Path, models: list, data: list | None, overwrite: bool) -> Path:
    """`check_destination` for a tool that reads MODELS (paths or Hub ids; None is skipped) and DATA (files or
    folders; DST may lie in neither); a model folder may not hold a symbolic link out of it (`check_source_links`)."""
    sources, data_folders = _run_sources(models, data)
    dst = check_destination(dst, sources, overwrite, data_folders)
    for path in sources:  # what a tool copies from a model folder (model card, tokenizer) stays inside it
        if path.is_dir() and path not in data_folders:
            check_source_links(path)
    return dst


def check_run_place(dst: str | Path, models: list, data: list | None) -> Path:
    """`check_place` for a tool that reads MODELS and DATA (see `check_run_destination`)."""
    sources, data_folders = _run_sources(models, data)
    return check_place(dst, sources, data_folders)


def _run_sources(models: list, data: list | None) -> tuple[list[Path], list[Path]]:
    data_paths = [Path(str(d)).expanduser() for d in data or []]
    model_paths = [Path(str(m)).expanduser() for m in models if m is not None]
    sources = [path for path in (*model_paths, *data_paths) if path.exists()]
    return sources, [path for path in data_paths if path.is_dir()]


def check_file_destination(path: str | Path, overwrite: bool) -> Path:
    """The absolute PATH of a file kha is about to write (a plot), or KHAError: never through a symbolic link (it
    would write wherever the link points), never over a folder, and over an existing file only with OVERWRITE."""
    path = Path(path).expanduser().absolute()
    if path.is_symlink():
        raise KHAError(
            f"{path} is a symbolic link to {os.readlink(path)}; kha does not write through links: name another file"
        )
    if path.exists():
        if not path.is_file():
            raise KHAError(f"{path} exists and is not a file; name another file")
        if not overwrite:
            raise KHAError(f"{path} already exists; pass --overwrite to replace it")
    return path


def is_training_run(folder: Path) -> bool:
    """True for a folder holding transformers Trainer checkpoints (checkpoint-N/trainer_state.json), or the finished
    runs of an interrupted `kha ab` (its run cache: runs/ARM-seedN.json beside ab_settings.json)."""
    if any(path.is_file() for path in folder.glob("checkpoint-*/trainer_state.json")):
        return True
    return (folder / "ab_settings.json").is_file() and any(path.is_file() for path in folder.glob("runs/*-seed*.json"))


def check_replaceable(dst: Path) -> None:
    """`--overwrite` removes only a folder kha wrote (its `.kha-output` marker, a regular file), and only one it can
    remove completely. A config.json or checkpoint-N folders are not enough: any folder may hold those."""
    if dst.is_symlink() or not dst.is_dir():
        raise KHAError(f"{dst} exists and is not a folder; --overwrite replaces folders kha wrote only")
    if not has_output_marker(dst):
        raise KHAError(
            f"{dst} exists and has no {OUTPUT_MARKER} marker, so it does not look like a folder kha wrote (a "
            "config.json or checkpoints are not enough; folders written by earlier kha-hf releases have none either); "
            "--overwrite will not remove it: delete it yourself or name another folder"
        )
    if dst.name.startswith(".kha-") and os.path.lexists(dst / PARTIAL_MARKER):
        raise KHAError(f"{dst} is the temporary folder of a kha run, not an output; name another folder")
    if not os.access(dst, os.W_OK | os.X_OK) or not os.access(dst.parent, os.W_OK | os.X_OK):
        raise KHAError(f"{dst} cannot be replaced: no permission to remove it (or to write in {dst.parent})")


def has_output_marker(folder: Path) -> bool:
    """True when FOLDER (a real folder) holds kha's `.kha-output` marker as a regular file (not a link)."""
    import stat

    try:
        return stat.S_ISREG(os.lstat(folder / OUTPUT_MARKER).st_mode)
    except OSError:
        return False


def source_roots(folder: Path) -> list[Path]:
    """Where the files of a source FOLDER may really live: the folder itself, and for a Hugging Face cache snapshot
    (`models--o--n/snapshots/<rev>/x -> ../../blobs/<hash>`) the repository's blobs folder."""
    real = _real(folder)
    roots = [real]
    if real.parent.name == "snapshots":
        roots.append(real.parent.parent / "blobs")
    return roots


def confined_file(folder: Path, path: Path) -> Path:
    """PATH (an entry of the source FOLDER), or KHAError when it is a symbolic link whose target lies outside
    FOLDER (and outside a Hub cache's blobs): such a link would copy a file the source's author chose from anywhere
    on this machine into the output."""
    if not path.is_symlink():
        return path
    target = _real(path)
    if target.is_dir():
        return path  # kha reads and copies the files of a source's top level only, never a linked folder
    if not any(_is_within(target, root) for root in source_roots(folder)):
        raise KHAError(
            f"{path} is a symbolic link to {os.readlink(path)}, outside the source folder {folder}; kha copies only "
            "files inside the source: replace the link by the file itself, or remove it"
        )
    return path


def check_source_links(folder: Path, names: list[str] | None = None) -> None:
    """`confined_file` for every top-level entry of FOLDER (or only NAMES): refused before anything is written."""
    folder = Path(folder)
    entries = [folder / name for name in names] if names is not None else sorted(folder.iterdir())
    for path in entries:
        confined_file(folder, path)
