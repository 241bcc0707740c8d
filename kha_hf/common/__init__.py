"""Helpers shared by several parts: the user-facing error type, the checkpoint reader (`checkpoint.py`) and the
rules it checks with (`checks.py`), model loading for the tools, the PyPI assets."""
