"""Writing a checkpoint folder safely: a temporary sibling renamed into place on success, never half-written."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..common.errors import KHAError
from ..common.version import __version__
from .paths import (
    OUTPUT_MARKER,
    PARTIAL_MARKER,
    check_file_destination,
    check_replaceable,
    confined_file,
    is_training_run,
)

# Files that describe weights or the model itself: each tool writes its own; everything else is carried over.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".onnx", ".ckpt")
NOT_CARRIED = {"config.json", "README.md", ".gitattributes", "model.safetensors.index.json"}


PARTIAL_PREFIX, PARTIAL_SUFFIX = ".kha-", ".partial"  # `.kha-<random>.partial`: short, so any valid DST name works

WRITING = "writing"  # a run is writing it (or was, until it was SIGKILLed)
RESUMABLE = "resumable"  # a training run stopped by a signal or an error kept it: `kha train --resume` adopts it
OLD = "old"  # the previous DST, swapped out by --overwrite and being removed


@dataclass(frozen=True)
class Partial:
    """A temporary folder of a run writing DST (found by its marker, never by its name alone)."""

    folder: Path
    state: str
    alive: bool  # a run holds its lock (or the file system cannot say: then it is left alone)


@contextlib.contextmanager
def atomic_output_dir(
    dst: str | Path,
    overwrite: bool = False,
    keep_on_failure: Callable[[Path], bool] | None = None,
    adopt: Path | None = None,
    marker: str | None = None,
    kept_hint: str = "continue it with --resume",
) -> Iterator[Path]:
    """Yield an empty temporary folder beside DST; on success it becomes DST, on any failure it is removed.

    - The temporary folder is `.kha-<random>.partial` (its `.kha-partial` marker names DST; the run holds its lock
      while it works), so any DST name the file system accepts works.
    - The existence check is atomic with the final rename (Linux `renameat2`): a DST that appears while we work
      (another run, another program) is never replaced without `overwrite`; that run fails instead.
    - With `overwrite`, the new folder is swapped in atomically and the old one removed only then, and only if kha
      wrote it (its `.kha-output` marker, `paths.check_replaceable`).
    - The swap is the commit point: a signal before it removes the temporary folder and leaves DST as it was; one
      that arrives during the swap or after it is noted and the run ends as a success (DST is the new output).
    - SIGINT, SIGTERM and SIGHUP before the swap remove the temporary folder. After SIGKILL or a power cut, DST is
      absent or as it was, and the next run removes the partial it finds whose owning process is gone, unless it
      holds training checkpoints: that one is kept for `kha train --resume`, and a plain run of DST is refused.
    - `keep_on_failure(tmp)` true (a training run with checkpoints): the folder is kept, marked resumable, for
      `adopt` by a later run, which continues in it instead of a new one.
    - `marker`: the command name written to `.kha-output`, which every folder kha writes carries: --overwrite
      replaces nothing else.
    - `kept_hint`: how to continue a kept folder, printed when one is kept.

    Callers check the destination first (`paths.check_destination`); this re-checks at the rename.
    """
    dst = Path(dst).expanduser().absolute()
    if (dst.exists() or dst.is_symlink()) and not overwrite:
        raise KHAError(f"{dst} already exists; pass --overwrite (overwrite=True from Python) to replace it")
    lock = None
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(dst)
        if adopt is None:
            check_no_interrupted_run(dst)
            tmp = Path(tempfile.mkdtemp(prefix=PARTIAL_PREFIX, suffix=PARTIAL_SUFFIX, dir=dst.parent))
        else:
            tmp = check_adoptable(adopt, dst)
        lock = _lock(tmp, created=adopt is None)  # held until the end: two runs never work in one folder
        _write_partial_marker(tmp, dst, WRITING)
        # the version tells what the folder holds (a training run of a version that names it has kha_data.json)
        stamp = {"command": f"kha {marker or 'output'}", "version": __version__}
        _write_new_file(tmp / OUTPUT_MARKER, json.dumps(stamp) + "\n")
    except BaseException as err:
        if lock is not None:
            os.close(lock)
        if isinstance(err, OSError):
            raise KHAError(f"cannot write next to {dst}: {err.strerror or err}") from err
        raise
    committed = False
    try:
        with _signals_raise_interrupt():
            yield tmp
            from ..modeling.modeling_kha import apply_umask  # the modes a plain `cp` gives (hard links untouched)

            apply_umask(tmp, "*", folder_too=True)
            with _signals_deferred() as received:
                old = _move_into_place(tmp, dst, overwrite)  # the commit point
                committed = True
                _clear_after_commit(dst, old)
        if received:
            names = ", ".join(sorted({signal.Signals(s).name for s in received}))
            print(f"received {names} after {dst} was put in place: the run completed", file=sys.stderr)
    except BaseException as err:
        if committed:
            raise
        if keep_on_failure is not None and keep_on_failure(tmp):
            _write_partial_marker(tmp, dst, RESUMABLE)
            print(f"the unfinished run is kept in {tmp}: {kept_hint}, or delete that folder")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        if _is_disk_full(err):  # name the folder being written, not whichever file the failing call read
            raise KHAError(f"no space left on the device while writing {dst}; nothing was put in place") from err
        raise
    finally:
        if lock is not None:
            os.close(lock)


def _lock(folder: Path, created: bool) -> int | None:
    """An exclusive lock on FOLDER for as long as this run works in it (released by the kernel when the process
    ends, however it ends): two `--resume` runs never continue the same kept folder. None where the file system
    has no locks."""
    if created:  # a folder this run just made: another run holding it is a bug, not a refusal
        return hold_lock(folder, None)
    return hold_lock(folder, f"{folder} is being continued by another run")


def hold_lock(folder: Path, refusal: str | None) -> int | None:
    """A descriptor holding an exclusive lock on FOLDER (a folder, never followed through a link), or None where
    the file system has no locks; held by another process: KHAError(REFUSAL) (BlockingIOError without one)."""
    import fcntl

    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        if refusal is None:
            raise
        raise KHAError(refusal) from None
    except OSError:
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def atomic_output_file(path: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a new temporary file beside PATH (same suffix); on success it is renamed to PATH, on any failure
    removed. The rename replaces a file (with `overwrite`) or a link itself, never writing through one; PATH is
    checked first (`paths.check_file_destination`) and again at the rename. The temporary file is locked while it
    is written: one that a SIGKILLed run left (unlocked, `.kha-file-*` with PATH's suffix) is removed first."""
    import fcntl

    path = check_file_destination(path, overwrite)
    remove_stale_partial_files(path.parent, path.suffix)
    try:
        fd, name = tempfile.mkstemp(prefix=PARTIAL_FILE_PREFIX, suffix=path.suffix, dir=path.parent)
    except OSError as err:
        raise KHAError(f"cannot write {path}: {err.strerror or err}") from err
    fcntl.flock(fd, fcntl.LOCK_EX)  # held until this run ends, however it ends (a kill releases it too)
    tmp = Path(name)
    try:
        with _signals_raise_interrupt():
            yield tmp
            from ..modeling.modeling_kha import apply_umask

            apply_umask(tmp.parent, tmp.name)  # mkstemp's 0600 -> the modes a plain `cp` gives
            check_file_destination(path, overwrite)  # it may have changed meanwhile
            if overwrite:
                os.replace(tmp, path)
            else:
                try:
                    rename_noreplace(tmp, path)
                except FileExistsError:
                    raise KHAError(f"{path} appeared while kha was writing it; it was not replaced") from None
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    finally:
        os.close(fd)


# `.kha-file-<random><suffix>`: a file being written by `atomic_output_file`, locked (flock) by its writer
PARTIAL_FILE_PREFIX = ".kha-file-"
# exactly what tempfile.mkstemp makes of the prefix: 8 characters of [a-z0-9_], then the suffix (a user's own
# `.kha-file-notes.gguf` does not match)
PARTIAL_FILE_NAME = re.compile(re.escape(PARTIAL_FILE_PREFIX) + r"[a-z0-9_]{8}\.[A-Za-z0-9]+")
STALE_FILE_SECONDS = 60  # a file this old and unlocked is no run's: one just made is locked within microseconds


def remove_stale_partial_files(folder: Path, suffix: str) -> list[Path]:
    """Remove FOLDER's temporary files of `atomic_output_file` (with SUFFIX) that no process holds locked: left
    by a run that was killed (SIGKILL, a crash of the machine). Returns what was removed."""
    import fcntl

    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    if not suffix:  # every output file kha writes has a suffix (.gguf, .png): nothing else is looked at
        return removed
    for entry in entries:
        if not PARTIAL_FILE_NAME.fullmatch(entry.name) or not entry.name.endswith(suffix):
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            if time.time() - entry.stat(follow_symlinks=False).st_mtime < STALE_FILE_SECONDS:
                continue
            fd = os.open(entry.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while its writer runs
            os.unlink(entry.path)
            removed.append(Path(entry.path))
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _is_disk_full(err: BaseException) -> bool:
    """ENOSPC from Python, or from safetensors (whose SafetensorError is no OSError)."""
    if isinstance(err, OSError):
        return err.errno in (errno.ENOSPC, errno.EDQUOT)
    return type(err).__name__ == "SafetensorError" and "No space left" in str(err)


def _write_new_file(path: Path, text: str) -> None:
    """Write PATH afresh: whatever was there (a symbolic link included) is removed first, never written through."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _write_partial_marker(folder: Path, dst: Path, state: str) -> None:
    record = {"destination": dst.name, "state": state}  # its owner is whoever holds its lock (`_lock`)
    _write_new_file(folder / PARTIAL_MARKER, json.dumps(record) + "\n")


def _read_partial(folder: Path, dst: Path) -> Partial | None:
    """The Partial of FOLDER when it is a real folder (not a link) whose marker (a regular file) names DST; None
    for anything else."""
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            return None
        fd = os.open(folder / PARTIAL_MARKER, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            record = json.loads(f.read(65536).decode("utf-8"))
        state = record["state"]
    except (OSError, ValueError, KeyError, TypeError):  # no marker, or not kha's: JSON of another shape
        return None
    if record.get("destination") != dst.name or not isinstance(state, str):
        return None
    return Partial(folder, state, _locked(folder))


def _partials(dst: Path) -> list[Partial]:
    """Every temporary folder of a run writing DST, found beside it by its marker."""
    try:
        entries = list(os.scandir(dst.parent))
    except OSError:
        return []
    names = (e.name for e in entries if e.name.startswith(PARTIAL_PREFIX) and e.name.endswith(PARTIAL_SUFFIX))
    return [p for p in (_read_partial(dst.parent / name, dst) for name in names) if p is not None]


def resumable_partials(dst: Path) -> list[Path]:
    """Kept folders of interrupted runs of DST (newest first): real folders with kha's marker naming DST, whose
    owning process is gone, holding training checkpoints (kept on a signal, or left by a SIGKILLed run)."""
    dst = Path(dst).expanduser().absolute()
    found = [
        p.folder
        for p in _partials(dst)
        if not p.alive and p.state in (WRITING, RESUMABLE) and is_training_run(p.folder)
    ]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def check_no_interrupted_run(dst: Path) -> None:
    """KHAError when an interrupted training run of DST kept its checkpoints: a new run does not delete them, nor
    leave them to be picked up by a later --resume instead of its own result."""
    kept = resumable_partials(dst)
    if kept:
        raise KHAError(
            f"an interrupted run of {Path(dst).name} kept its checkpoints in {kept[0]}: continue it with "
            "`kha train ... --resume`, or delete that folder to start afresh"
        )


def check_adoptable(folder: Path, dst: Path) -> Path:
    """FOLDER, when `--resume` may continue in it: a real folder (never a symbolic link) beside DST with kha's
    marker naming DST, whose owner is gone, holding checkpoints; else KHAError."""
    folder = Path(folder)
    dst = Path(dst).expanduser().absolute()
    partial = _read_partial(folder, dst)
    if (
        partial is None
        or folder.absolute().parent != dst.parent
        or partial.alive
        or partial.state not in (WRITING, RESUMABLE)
        or not is_training_run(folder)
    ):
        raise KHAError(f"{folder} is not an interrupted run of {dst} that --resume may continue")
    return folder


def _locked(folder: Path) -> bool:
    """True when a run holds FOLDER's lock (`_lock`, held by the kernel for as long as the run lives, however it
    ends), or when that cannot be told (a file system without locks): such a folder is never removed or adopted."""
    try:
        fd = _lock(folder, created=True)
    except OSError:  # BlockingIOError: a run holds it; or the folder cannot be opened
        return True
    if fd is None:
        return True
    os.close(fd)  # closing releases the lock taken here
    return False


def _move_into_place(tmp: Path, dst: Path, overwrite: bool) -> Path | None:
    """Rename TMP to DST (the commit point); with OVERWRITE swap them. Returns where the old DST now is, or None."""
    if not overwrite or not (dst.exists() or dst.is_symlink()):
        try:
            rename_noreplace(tmp, dst)
            return None
        except FileExistsError:
            if not overwrite:
                raise KHAError(f"{dst} appeared while this run was writing; it was not replaced") from None
    check_replaceable(dst)  # it may have changed since the first check
    exchange(tmp, dst)  # tmp now holds the old folder, removed after the commit
    return tmp


def _clear_after_commit(dst: Path, old: Path | None) -> None:
    """After the swap: DST loses its temporary marker; the old folder is marked as such (a SIGKILL from here on
    leaves it for the next run to remove) and removed. Errors here cannot undo the commit: they are ignored."""
    with contextlib.suppress(OSError):
        (dst / PARTIAL_MARKER).unlink()
    if old is not None:
        with contextlib.suppress(OSError):
            _write_partial_marker(old, dst, OLD)
        shutil.rmtree(old, ignore_errors=True)


def remove_stale_partials(dst: Path) -> list[Path]:
    """Remove the temporary folders of runs writing DST whose run has ended (no lock held), except those holding
    training checkpoints (kept for `--resume`)."""
    dst = Path(dst).expanduser().absolute()
    removed = []
    for partial in _partials(dst):
        if partial.alive:
            continue
        if partial.state != OLD and is_training_run(partial.folder):
            continue  # an interrupted training run: resumable, never deleted silently
        shutil.rmtree(partial.folder, ignore_errors=True)
        removed.append(partial.folder)
    return removed


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived: unwinds like Ctrl-C, so temporary output is removed."""


@contextlib.contextmanager
def _signal_handlers(signals: tuple[signal.Signals, ...], handler) -> Iterator[None]:
    """HANDLER for SIGNALS while the block runs, then the previous ones (in the main thread only: Python sets
    handlers nowhere else)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _signals_raise_interrupt():
    """SIGTERM and SIGHUP unwind like Ctrl-C (`Terminated`), so temporary output is removed."""

    def handler(signum, frame):
        raise Terminated(f"received {signal.Signals(signum).name}")

    return _signal_handlers((signal.SIGTERM, signal.SIGHUP), handler)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[list[int]]:
    """SIGINT, SIGTERM and SIGHUP are recorded, not acted on, around the commit (the swap and the old folder's
    removal): the run ends either before it (nothing changed) or after it (a success), never half-way."""
    received: list[int] = []
    with _signal_handlers(
        (signal.SIGINT, signal.SIGTERM, signal.SIGHUP), lambda signum, frame: received.append(signum)
    ):
        yield received


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
    aside = Path(tempfile.mkdtemp(prefix=PARTIAL_PREFIX, suffix=".old", dir=b.parent)) / "x"
    os.rename(b, aside)
    os.rename(a, b)
    os.rename(aside, a)
    aside.parent.rmdir()


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
    """Copy tokenizer, chat template, generation config, license... : every top-level non-weight file. A symbolic
    link out of SRC is refused (`paths.confined_file`): nothing from elsewhere on this machine reaches DST."""
    carried = []
    for path in sorted(src.iterdir()):
        if path.name.startswith(".") or path.name in NOT_CARRIED or not path.is_file():
            continue
        if path.name.endswith(WEIGHT_SUFFIXES) or path.suffix == ".py":
            continue
        shutil.copyfile(confined_file(src, path), dst / path.name)
        carried.append(path.name)
    return carried


def check_free_space(folder: Path, needed: int, what: str) -> None:
    """KHAError with both sizes when the file system of FOLDER (or of its nearest existing parent, for a folder
    still to be made) has less than NEEDED bytes free."""
    folder = Path(folder).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise KHAError(f"not enough free space in {folder} for {what}: needs {_size(needed)}, {_size(free)} available")


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"
