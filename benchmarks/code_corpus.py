"""A second training domain for `kha ab --from ... --data`: Python source code from an installed PyPI package, one
document per module, written as JSON lines (`{"text": ...}`), sorted by path so the corpus is the same on every
machine that has the same version of the package.

    python benchmarks/code_corpus.py /tmp/code.jsonl                 # transformers.generation (the pinned version)
    python benchmarks/code_corpus.py /tmp/code.jsonl --package peft  # any importable package (not a single module)
    kha ab --from "$(kha assets --gguf)" --arms adapters --data /tmp/code.jsonl
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import tempfile
import tokenize
from importlib.metadata import packages_distributions, version
from pathlib import Path


class CorpusError(Exception):
    """A one-line reason why the corpus cannot be written."""


def code_documents(package: str) -> list[tuple[str, str]]:
    """(relative path, source) of every .py file inside PACKAGE's folder, sorted by path; empty files dropped. Files
    are decoded as Python decodes them (a coding cookie, else UTF-8); links that point outside the package are
    skipped."""
    if not package:
        raise CorpusError("--package is empty")
    try:
        module = importlib.import_module(package)
    except ImportError as err:
        raise CorpusError(f"cannot import {package!r}: {err}") from None
    file = getattr(module, "__file__", None)
    if not hasattr(module, "__path__") or file is None or Path(file).name != "__init__.py":
        raise CorpusError(f"{package!r} is a module or a namespace package, not a package with a folder of its own")
    root = Path(module.__file__).resolve().parent
    documents = []
    for path in sorted(Path(module.__file__).parent.rglob("*.py")):
        real = path.resolve()
        if not real.is_file() or not real.is_relative_to(root):
            continue
        try:
            with tokenize.open(real) as f:
                text = f.read()
        except (SyntaxError, UnicodeDecodeError) as err:
            raise CorpusError(f"{path}: cannot decode it as Python source ({err})") from None
        if text.strip():
            documents.append((str(path.relative_to(root)), text))
    if not documents:
        raise CorpusError(f"{package!r} holds no non-empty .py files")
    return documents


def describe_version(package: str) -> str:
    top = package.split(".")[0]
    distributions = packages_distributions().get(top) or [top]
    try:
        return f"{distributions[0]} {version(distributions[0])}"
    except Exception:  # installed without metadata (a source checkout): say so, do not fail
        return f"{top}, version unknown"


def write_corpus(output: Path, documents: list[tuple[str, str]]) -> None:
    """Write DOCUMENTS to OUTPUT whole or not at all, never over an existing file or link."""
    if os.path.lexists(output):
        raise CorpusError(f"{output} exists; remove it or choose another name")
    if not output.parent.is_dir():
        raise CorpusError(f"{output.parent} is not a folder")
    fd, tmp = tempfile.mkstemp(prefix=f".{output.name}.", dir=output.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it owner-only; the corpus is an ordinary file
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            for _, text in documents:
                out.write(json.dumps({"text": text}) + "\n")
        os.link(tmp, output)  # fails if OUTPUT appeared meanwhile: nothing is overwritten
    except FileExistsError:
        raise CorpusError(f"{output} exists; remove it or choose another name") from None
    finally:
        os.unlink(tmp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", type=Path, help="the .jsonl file to write (refused if it exists)")
    parser.add_argument("--package", default="transformers.generation", help="an importable package")
    args = parser.parse_args()
    if args.output.suffix != ".jsonl":
        parser.error(f"{args.output}: the corpus is written as JSON lines; name it *.jsonl")
    try:
        documents = code_documents(args.package)
        source = describe_version(args.package)
        write_corpus(args.output, documents)
    except CorpusError as err:
        parser.error(str(err))
    size = sum(len(text) for _, text in documents)
    print(f"wrote {len(documents)} modules of {args.package} ({source}), {size:,} characters")


if __name__ == "__main__":
    main()
