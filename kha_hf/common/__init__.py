"""Helpers shared by several parts: the user-facing error type, model loading for the tools, the PyPI assets."""
