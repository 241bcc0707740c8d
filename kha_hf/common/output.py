"""Writing a checkpoint folder safely: a temporary sibling renamed into place on success, never half-written."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import glob
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import KHAError
from .paths import OUTPUT_MARKER, check_replaceable

# Files that describe weights or the model itself: each tool writes its own; everything else is carried over.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".onnx", ".ckpt")
NOT_CARRIED = {"config.json", "README.md", ".gitattributes", "model.safetensors.index.json"}


PARTIAL_MARKER = ".kha-partial"  # inside each temporary folder: who owns it (host and process id)


RESUMABLE = "resumable"  # the marker's second line in a kept training folder: `kha train --resume` adopts it


@contextlib.contextmanager
def atomic_output_dir(
    dst: str | Path,
    overwrite: bool = False,
    keep_on_failure: Callable[[Path], bool] | None = None,
    adopt: Path | None = None,
    marker: str | None = None,
) -> Iterator[Path]:
    """Yield an empty temporary folder beside DST; on success it becomes DST, on any failure it is removed.

    - The existence check is atomic with the final rename (Linux `renameat2`): a DST that appears while we work
      (another run, another program) is never replaced without `overwrite`; that run fails instead.
    - With `overwrite`, the new folder is swapped in atomically and the old one removed only then, and only if it
      looks like a folder kha or transformers wrote (`paths.check_replaceable`).
    - SIGINT, SIGTERM and SIGHUP remove the temporary folder. After SIGKILL or a power cut, DST is absent or as
      it was, and the next run removes the `.NAME.*.partial` folder it finds whose owning process is gone.
    - `keep_on_failure(tmp)` true (a training run with checkpoints): the folder is kept, marked resumable, for
      `adopt` by a later run, which continues in it instead of a new one.
    - `marker`: the command name written to `.kha-output` in a results folder, so --overwrite may replace it later.

    Callers check the destination first (`paths.check_destination`); this re-checks at the rename.
    """
    dst = Path(dst).expanduser().absolute()
    if (dst.exists() or dst.is_symlink()) and not overwrite:
        raise KHAError(f"{dst} already exists; pass --overwrite (overwrite=True from Python) to replace it")
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(dst)
        tmp = adopt or Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent))
        (tmp / PARTIAL_MARKER).write_text(f"{socket.gethostname()} {os.getpid()}\n")
        if marker:
            (tmp / OUTPUT_MARKER).write_text(json.dumps({"command": f"kha {marker}"}) + "\n")
    except OSError as err:
        raise KHAError(f"cannot write next to {dst}: {err.strerror or err}") from err
    try:
        with _signals_raise_interrupt():
            yield tmp
            (tmp / PARTIAL_MARKER).unlink()
            _apply_umask(tmp)
            _move_into_place(tmp, dst, overwrite)
    except BaseException as err:
        if keep_on_failure is not None and keep_on_failure(tmp):
            (tmp / PARTIAL_MARKER).write_text(f"{socket.gethostname()} {os.getpid()}\n{RESUMABLE}\n")
            print(f"the unfinished run is kept in {tmp}: continue it with --resume, or delete that folder")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        if _is_disk_full(err):  # name the folder being written, not whichever file the failing call read
            raise KHAError(
                f"no space left on the device of {dst.parent} while writing {dst.name}; nothing was put in place"
            ) from err
        raise


def _is_disk_full(err: BaseException) -> bool:
    """ENOSPC from Python, or from safetensors (whose SafetensorError is no OSError)."""
    if isinstance(err, OSError):
        return err.errno in (errno.ENOSPC, errno.EDQUOT)
    return type(err).__name__ == "SafetensorError" and "No space left" in str(err)


def resumable_partials(dst: Path) -> list[Path]:
    """Kept folders of interrupted runs for DST (newest first), whose owning process is gone."""
    dst = Path(dst).expanduser().absolute()
    found = []
    for folder in dst.parent.glob(f".{glob.escape(dst.name)}.*.partial"):
        owner = _marker_owner(folder)
        if owner is not None and owner[2] and not owner[1]:
            found.append(folder)
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def _marker_owner(folder: Path) -> tuple[str, bool, bool] | None:
    """(host, alive, resumable) from a partial folder's marker; None when it is not ours."""
    try:
        lines = (folder / PARTIAL_MARKER).read_text().splitlines()
        owner_host, pid = lines[0].split()
        alive = owner_host != socket.gethostname() or _process_exists(int(pid))
    except (OSError, ValueError, IndexError):
        return None
    return owner_host, alive, lines[1:] == [RESUMABLE]


def _move_into_place(tmp: Path, dst: Path, overwrite: bool) -> None:
    if not overwrite or not (dst.exists() or dst.is_symlink()):
        try:
            rename_noreplace(tmp, dst)
            return
        except FileExistsError:
            if not overwrite:
                raise KHAError(f"{dst} appeared while this run was writing; it was not replaced") from None
    check_replaceable(dst)  # it may have changed since the first check
    exchange(tmp, dst)  # tmp now holds the old folder, removed below
    shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_partials(dst: Path) -> list[Path]:
    """Remove `.DST.*.partial` siblings left by runs of this tool on this host whose process no longer exists
    (except those kept for `--resume`)."""
    removed = []
    for folder in dst.parent.glob(f".{glob.escape(dst.name)}.*.partial"):
        owner = _marker_owner(folder)
        if owner is None or owner[2]:
            continue  # not ours (no marker), or kept on purpose for --resume: leave it
        if not owner[1]:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived: unwinds like Ctrl-C, so temporary output is removed."""


@contextlib.contextmanager
def _signals_raise_interrupt() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated(f"received {signal.Signals(signum).name}")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


# Linux renameat2 flags: fail if the target exists / swap two paths atomically.
_RENAME_NOREPLACE, _RENAME_EXCHANGE, _AT_FDCWD = 1, 2, -100


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """True if done; False where renameat2 is unavailable (other OS, old libc, unsupported file system)."""
    libc = _libc()
    if libc is None:
        return False
    if libc.renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    errno_ = ctypes.get_errno()
    if errno_ in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(errno_, os.strerror(errno_), str(dst))


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.renameat2  # noqa: B018 - probe: glibc >= 2.28
    except (OSError, AttributeError):
        return None
    return libc


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename SRC to DST; FileExistsError if DST exists (atomically where the OS allows)."""
    try:
        if _renameat2(src, dst, _RENAME_NOREPLACE):
            return
    except OSError as err:
        if err.errno == errno.EEXIST:
            raise FileExistsError(errno.EEXIST, "exists", str(dst)) from None
        raise
    if dst.exists() or dst.is_symlink():  # fallback: a check, then the rename (a small window remains)
        raise FileExistsError(errno.EEXIST, "exists", str(dst))
    os.rename(src, dst)


def exchange(a: Path, b: Path) -> None:
    """Swap two folders (atomically where the OS allows)."""
    if _renameat2(a, b, _RENAME_EXCHANGE):
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{b.name}.", suffix=".old", dir=b.parent)) / "x"
    os.rename(b, aside)
    os.rename(a, b)
    os.rename(aside, a)
    aside.parent.rmdir()


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


def place_file(src: Path, dst: Path, link: bool) -> str:
    """Copy byte for byte, or with `link` hard-link; never modifies SRC. Returns what was done.

    A SRC that is a symbolic link (the Hugging Face cache: `snapshots/<rev>/x -> ../../blobs/<hash>`) is followed:
    DST gets the blob's bytes or a hard link to the blob, never a copy of a relative link that would dangle.
    Where a hard link is impossible (another file system), DST becomes an absolute symbolic link to the real file.
    """
    if link:
        try:
            # realpath: CPython's os.link calls link(2), which links a symlink itself (a relative one would dangle)
            os.link(os.path.realpath(src), dst)
            return "hard-linked"
        except OSError as err:
            if err.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise
            os.symlink(os.path.realpath(src), dst)
            return "symlinked"
    shutil.copyfile(src, dst)  # follows links: copies the real file's bytes
    return "copied"


def report_placement(how: list[str], what: str = "shards") -> None:
    """One console line when --link could not hard-link everything, so users know what DST depends on."""
    linked = how.count("symlinked")
    if linked:
        print(
            f"--link: {linked} of {len(how)} {what} are on another file system and could not be hard-linked; "
            "they are symbolic links to the originals (the output breaks if those are deleted)"
        )


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
