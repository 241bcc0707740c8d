"""The `kha` console command. It parses and checks its arguments before kha_hf registers its model classes with
transformers (which imports transformers' modeling stack), so `kha --help` and argument errors answer quickly."""

import sys

DEFER_REGISTRATION = True  # read by kha_hf/__init__.py


def main() -> int:
    try:
        from kha_hf.cli import main as kha_main
    except ImportError as err:
        # kha_hf's own check of the installed transformers (kha_hf.common.supported_versions, which importing any
        # part of kha_hf runs first): one line, not a traceback
        if type(err).__name__ != "UnsupportedTransformers":
            raise
        print(f"kha: error: {err}", file=sys.stderr)
        return 2
    return kha_main()


if __name__ == "__main__":
    sys.exit(main())
