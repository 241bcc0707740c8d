"""The `kha` console command. It parses and checks its arguments before kha_hf registers its model classes with
transformers (which imports transformers' modeling stack), so `kha --help` and argument errors answer quickly."""

import sys

DEFER_REGISTRATION = True  # read by kha_hf/__init__.py (as sys.modules["kha_hf_entry"].DEFER_REGISTRATION)

# `python -m kha_hf_entry` runs this file as __main__: file it under its own name too, or kha_hf/__init__.py would
# not see the flag and would import the modeling stack before parsing (seconds on every `--help`).
sys.modules.setdefault("kha_hf_entry", sys.modules[__name__])


def main() -> int:
    try:
        from kha_hf.cli import main as kha_main
    except ImportError as err:
        # kha_hf's own check of the installed transformers (kha_hf.common.supported_versions, which importing any
        # part of kha_hf runs first): one line, not a traceback
        if type(err).__name__ != "UnsupportedTransformers":
            raise
        if sys.argv[1:] == ["--version"]:  # what is installed is what the user needs to see here
            print(_versions_from_metadata())
            print(f"kha: warning: {err}", file=sys.stderr)
            return 0
        print(f"kha: error: {err}", file=sys.stderr)
        return 2
    return kha_main()


def _versions_from_metadata() -> str:
    """`kha --version`'s line, read from the distributions' metadata: kha_hf itself cannot be imported here."""
    from importlib import metadata

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    libraries = ", ".join(f"{name} {installed(name)}" for name in ("transformers", "torch", "peft"))
    return f"kha-hf {_own_version()} ({libraries})"


def _own_version() -> str:
    """kha_hf.__version__ from its file (finding a top-level package does not import it)."""
    import importlib.util
    from pathlib import Path

    package = importlib.util.find_spec("kha_hf")
    path = Path(package.submodule_search_locations[0]) / "common" / "version.py"
    spec = importlib.util.spec_from_file_location("_kha_hf_version", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.__version__


if __name__ == "__main__":
    sys.exit(main())
