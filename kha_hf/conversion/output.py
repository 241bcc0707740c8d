"""Writing a checkpoint folder safely: a temporary sibling renamed into place on success, never half-written."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..errors import KHAError

# Files that describe weights or the model itself: each tool writes its own; everything else is carried over.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".onnx", ".ckpt")
NOT_CARRIED = {"config.json", "README.md", ".gitattributes", "model.safetensors.index.json"}


@contextlib.contextmanager
def atomic_output_dir(dst: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder beside DST; on success it becomes DST, on any failure it is removed.

    After a crash or kill DST is absent or as it was (a hidden `.NAME.*.partial` folder may be left to delete).
    """
    dst = Path(dst).expanduser().absolute()
    if dst.exists() and not overwrite:
        raise KHAError(f"{dst} already exists; pass --overwrite to replace it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent))
    try:
        yield tmp
        _apply_umask(tmp)
        if dst.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".old", dir=dst.parent))
            os.replace(dst, old / "x")
            os.replace(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _apply_umask(folder: Path) -> None:
    # mkdtemp and safetensors create owner-only files; give what we wrote the modes a plain `cp` would.
    # Hard links are skipped: their mode is the source's, which must stay untouched.
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        info = path.lstat()
        if path.is_file() and not path.is_symlink() and info.st_nlink == 1:
            path.chmod(0o666 & ~umask)


def place_file(src: Path, dst: Path, link: bool) -> None:
    """Copy byte for byte, or with `link` hard-link (symlink across file systems); never modifies SRC."""
    if link:
        try:
            os.link(src, dst)
            return
        except OSError:
            os.symlink(src.resolve(), dst)
            return
    shutil.copyfile(src, dst)


def carry_over_files(src: Path, dst: Path) -> list[str]:
    """Copy tokenizer, chat template, generation config, license... : every top-level non-weight file."""
    carried = []
    for path in sorted(src.iterdir()):
        if path.name.startswith(".") or path.name in NOT_CARRIED or not path.is_file():
            continue
        if path.name.endswith(WEIGHT_SUFFIXES) or path.suffix == ".py":
            continue
        shutil.copyfile(path, dst / path.name)
        carried.append(path.name)
    return carried


def copy_model_code(dst: Path) -> list[str]:
    """Copy the self-contained KHA code files that `save_pretrained` would copy (remote code)."""
    from transformers.dynamic_module_utils import get_relative_import_files

    from .. import modeling_kha

    files = [Path(modeling_kha.__file__), *map(Path, get_relative_import_files(modeling_kha.__file__))]
    for path in files:
        shutil.copyfile(path, dst / path.name)
    return sorted(p.name for p in files)
