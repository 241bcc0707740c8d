"""The package version (one place: setup.cfg, kha_hf.__version__ and file metadata read it)."""

__version__ = "0.6.1"
