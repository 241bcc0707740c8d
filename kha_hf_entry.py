"""The `kha` console command. It parses and checks its arguments before kha_hf registers its model classes with
transformers (which imports transformers' modeling stack), so `kha --help` and argument errors answer quickly."""

import sys

DEFER_REGISTRATION = True  # read by kha_hf/__init__.py


def main() -> int:
    from kha_hf.cli import main as kha_main

    return kha_main()


if __name__ == "__main__":
    sys.exit(main())
