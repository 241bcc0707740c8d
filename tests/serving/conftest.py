"""What the server tests share."""

from __future__ import annotations

import multiprocessing.util
import tempfile

import pytest


@pytest.fixture(scope="session", autouse=True)
def _multiprocessing_temp_dir_outside_pytest_s_folder(tmp_path_factory):
    """transformers >= 5.25 spawns the model's process, and multiprocessing makes its temporary folder on first use,
    under TMPDIR (pytest's base folder in this suite, removed before the interpreter exits, where multiprocessing
    removes its folder: a traceback after a passing run). It is made here, next to pytest's base folder."""
    saved = tempfile.tempdir
    tempfile.tempdir = str(tmp_path_factory.getbasetemp().parent)
    try:
        multiprocessing.util.get_temp_dir()
    finally:
        tempfile.tempdir = saved
    yield
