"""Test files of an upstream project (transformers, peft), taken from the published sdist of its installed version.

Nothing of their test code is kept in this repository: `prepare_sdist_tests` downloads the sdist from the package
index (`pip download`, once per version), extracts the named files of its `tests/` folder into a cache folder as a
package of our naming (their imports are relative), and returns the folder to put on `sys.path`.

Set `KHA_UPSTREAM_TESTS_CACHE` to choose the cache folder, or `KHA_SKIP_UPSTREAM_TESTS=1` to skip these tests on a
machine without access to a package index. Without that variable, an index that cannot be reached fails the run: a
CI whose upstream tests silently skipped would prove nothing.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tarfile
import tempfile
import zlib
from pathlib import Path
from types import ModuleType

import pytest


def cache_root(dist: str, version: str, recipe: object) -> Path:
    """The cache folder of DIST VERSION's tests, prepared by RECIPE (the files, stubs and edits: a changed recipe
    is a new folder, never an old extraction reused)."""
    default = Path.home() / ".cache" / "kha_hf" / "upstream-tests"
    root = Path(os.environ.get("KHA_UPSTREAM_TESTS_CACHE", default))
    return root / f"{dist}-{version}-{zlib.crc32(repr(recipe).encode()):08x}"


def _download_sdist(dist: str, version: str, into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
    command += ["--dest", str(into), f"{dist}=={version}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    found = sorted(into.glob(f"{dist}-{version}.tar.gz"))
    if done.returncode != 0 or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no sdist"]
        raise RuntimeError(f"could not download the {dist} {version} sdist: {tail[0]}")
    return found[0]


def _extract(sdist: Path, top: str, files: list[str], package: Path, stubs: dict[str, str], edits: dict) -> None:
    package.mkdir(parents=True)
    with tarfile.open(sdist) as archive:
        for name in files:
            try:
                member = archive.extractfile(f"{top}/tests/{name}")
            except KeyError:
                member = None
            if member is None:
                raise RuntimeError(f"the {top} sdist has no tests/{name}")
            text = member.read().decode()
            for old, new in edits.get(name, ()):  # each edit must still apply: an upstream change fails loudly
                if old not in text:
                    raise RuntimeError(f"tests/{name} of the {top} sdist no longer holds {old!r}")
                text = text.replace(old, new)
            (package / name).write_text(text)
    (package / "__init__.py").write_text("")
    for relative, text in stubs.items():
        path = package / relative
        path.parent.mkdir(exist_ok=True)
        (path.parent / "__init__.py").write_text("")
        path.write_text(text)


def prepare_sdist_tests(
    dist: str, version: str, files: list[str], package: str, stubs: dict[str, str] | None = None, edits=None
) -> Path:
    """The folder that holds PACKAGE (FILES of the DIST VERSION sdist's tests/, with STUBS written beside them and
    EDITS {file: [(old, new)]} applied), fetched and extracted on first use (atomically: a rename at the end)."""
    root = cache_root(dist, version, (files, stubs, edits))
    if all((root / package / name).is_file() for name in files):
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent, prefix=f".{dist}-{version}-") as work:
        work = Path(work)
        sdist = _download_sdist(dist, version, work)
        _extract(sdist, f"{dist}-{version}", files, work / "tree" / package, stubs or {}, edits or {})
        try:
            (work / "tree").rename(root)
        except OSError:  # another process got there first
            if not all((root / package / name).is_file() for name in files):
                raise
    return root


def import_sdist_tests(dist: str, version: str, files: list[str], package: str, module: str, **kwargs) -> ModuleType:
    """PACKAGE.MODULE from `prepare_sdist_tests`, imported; skips only when KHA_SKIP_UPSTREAM_TESTS=1."""
    if os.environ.get("KHA_SKIP_UPSTREAM_TESTS") == "1":
        pytest.skip("KHA_SKIP_UPSTREAM_TESTS=1", allow_module_level=True)
    try:
        importlib.import_module("parameterized")  # a dependency of transformers' tests (setup.cfg `test` extra)
        root = prepare_sdist_tests(dist, version, files, package, **kwargs)
    except (ImportError, RuntimeError, OSError, subprocess.SubprocessError) as error:
        raise RuntimeError(
            f"{dist}'s own tests are unavailable ({error}); "
            "set KHA_SKIP_UPSTREAM_TESTS=1 to skip them on a machine without a package index"
        ) from error
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(f"{package}.{module}")
