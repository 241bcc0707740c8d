"""What every part needs and that reads no checkpoint: the user-facing error type, text and JSON file reads, version
checks, statistics, model cards, the PyPI assets."""
