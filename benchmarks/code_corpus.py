"""A second training domain for `kha ab --from ... --data`: Python source code from an installed PyPI package, one
document per module, written as JSON lines (`{"text": ...}`), sorted by path so the corpus is the same on every
machine that has the same version of the package.

    python benchmarks/code_corpus.py /tmp/code.jsonl                 # transformers.generation (the pinned version)
    python benchmarks/code_corpus.py /tmp/code.jsonl --package peft  # any importable package
    kha ab --from "$(kha assets --gguf)" --arms adapters --data /tmp/code.jsonl
"""

from __future__ import annotations

import argparse
import importlib
import json
from importlib.metadata import version
from pathlib import Path


def code_documents(package: str) -> list[tuple[str, str]]:
    """(relative path, source) of every .py file under PACKAGE's folder, sorted by path; empty files dropped."""
    module = importlib.import_module(package)
    root = Path(module.__file__).parent
    files = sorted(root.rglob("*.py"))
    return [(str(f.relative_to(root)), text) for f in files if (text := f.read_text(encoding="utf-8")).strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", type=Path, help="the .jsonl file to write (refused if it exists)")
    parser.add_argument("--package", default="transformers.generation", help="an importable package")
    args = parser.parse_args()
    if args.output.suffix != ".jsonl":
        parser.error(f"{args.output}: the corpus is written as JSON lines; name it *.jsonl")
    if args.output.exists():
        parser.error(f"{args.output} exists; remove it or choose another name")
    documents = code_documents(args.package)
    distribution = args.package.split(".")[0]
    with open(args.output, "x", encoding="utf-8") as out:
        for _, text in documents:
            out.write(json.dumps({"text": text}) + "\n")
    size = sum(len(text) for _, text in documents)
    print(
        f"wrote {len(documents)} modules of {args.package} ({distribution} {version(distribution)}), "
        f"{size:,} characters"
    )


if __name__ == "__main__":
    main()
