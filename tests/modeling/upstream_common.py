"""transformers' own common model tests (`ModelTesterMixin`), from the published sdist of the installed version.

Nothing of transformers' test code is kept in this repository: `load_modeling_common()` downloads the sdist of the
installed transformers version from the package index (`pip download`, ~10 MB, once per version), extracts
`tests/test_modeling_common.py` into a cache folder and imports it. The sdist does not ship two modules that file
imports, `tests/exporters/test_export.py` (the base of `ModelTesterMixin`) and `tests/generation/test_utils.py`;
they are replaced by empty mixins, so torch.export and `generate` tests are not run from here (our own parity tests
cover `generate` and the KV cache against the stock model).

Set `KHA_UPSTREAM_TESTS_CACHE` to choose the cache folder, or `KHA_SKIP_UPSTREAM_TESTS=1` to skip these tests on a
machine without access to a package index. Without that variable, an index that cannot be reached fails the run:
a CI whose upstream tests silently skipped would prove nothing.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

import pytest
import transformers

PACKAGE = "transformers_upstream_tests"  # our name for the sdist's `tests` package (its imports are relative)
COMMON = "test_modeling_common.py"  # the one file taken from the sdist
STUBS = {  # modules the sdist lacks -> the empty stand-ins of what test_modeling_common imports from them
    "exporters/test_export.py": "class ExportTesterMixin:\n    pass\n",
    "generation/test_utils.py": "class GenerationTesterMixin:\n    pass\n",
}


def cache_root() -> Path:
    default = Path.home() / ".cache" / "kha_hf" / "upstream-tests"
    return Path(os.environ.get("KHA_UPSTREAM_TESTS_CACHE", default)) / transformers.__version__


def _download_sdist(version: str, into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
    command += ["--dest", str(into), f"transformers=={version}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    found = sorted(into.glob(f"transformers-{version}.tar.gz"))
    if done.returncode != 0 or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no sdist"]
        raise RuntimeError(f"could not download the transformers {version} sdist: {tail[0]}")
    return found[0]


def _extract(sdist: Path, version: str, package: Path) -> None:
    package.mkdir(parents=True)
    with tarfile.open(sdist) as archive:
        try:
            member = archive.extractfile(f"transformers-{version}/tests/{COMMON}")
        except KeyError:
            member = None
        if member is None:
            raise RuntimeError(f"the transformers {version} sdist has no tests/{COMMON}")
        (package / COMMON).write_bytes(member.read())
    (package / "__init__.py").write_text("")
    for relative, text in STUBS.items():
        path = package / relative
        path.parent.mkdir(exist_ok=True)
        (path.parent / "__init__.py").write_text("")
        path.write_text(text)


def _prepare() -> Path:
    """The folder that holds `PACKAGE`, fetched and extracted on first use (atomically: a rename at the end)."""
    root = cache_root()
    if (root / PACKAGE / COMMON).is_file():
        return root
    version = transformers.__version__
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent, prefix=f".{version}-") as work:
        work = Path(work)
        _extract(_download_sdist(version, work), version, work / "tree" / PACKAGE)
        try:
            (work / "tree").rename(root)
        except OSError:  # another process got there first
            if not (root / PACKAGE / COMMON).is_file():
                raise
    return root


def load_modeling_common() -> ModuleType:
    """transformers' `tests/test_modeling_common.py` of the installed version, imported; skips only when told to."""
    if os.environ.get("KHA_SKIP_UPSTREAM_TESTS") == "1":
        pytest.skip("KHA_SKIP_UPSTREAM_TESTS=1", allow_module_level=True)
    try:
        importlib.import_module("parameterized")  # test_modeling_common's own dependency (setup.cfg `test` extra)
        root = _prepare()
    except (ImportError, RuntimeError, OSError, subprocess.SubprocessError) as error:
        raise RuntimeError(
            f"transformers' common model tests are unavailable ({error}); "
            "set KHA_SKIP_UPSTREAM_TESTS=1 to skip them on a machine without a package index"
        ) from error
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(f"{PACKAGE}.test_modeling_common")
