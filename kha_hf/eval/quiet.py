"""Silence lm-eval warnings that are expected and harmless in kha's use of it, and nothing else.

- `pretrained` model kwarg is not of type `str`, and "Passed an already-initialized model through `pretrained`":
  we hand HFLM a model we loaded ourselves, on purpose, in one process (lm-eval 0.4.13 warns about any such model,
  once per model evaluated).
- "Custom kwargs can be passed to `--metadata`": printed for every task whose documents come from a
  `custom_dataset`, which is how the offline tasks read the local copies.
- "metric X is defined, but aggregation / higher_is_better is not": lm-eval's own YAML for copa (and a few others)
  leaves them to lm-eval's defaults, which it then uses.
Every other warning of lm-eval still shows.

One line is not a log record: lm-eval 0.4.13 records the git commit of the working directory by running
`git describe --always` with the terminal as its stderr, so outside a git checkout every evaluation prints
"fatal: not a git repository". Within the block the probe runs with stderr discarded (same result otherwise).
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
from collections.abc import Iterator

EXPECTED = (
    "`pretrained` model kwarg is not of type `str`",
    "Passed an already-initialized model through `pretrained`",
    "Custom kwargs can be passed to `--metadata`",
    "is defined, but aggregation is not",
    "is defined, but higher_is_better is not",
)
LOGGERS = ("lm_eval.models.huggingface", "lm_eval.api.task")


def _not_expected(record: logging.LogRecord) -> bool:
    """A logging filter: False (drop) for the EXPECTED messages."""
    return not any(text in record.getMessage() for text in EXPECTED)


def _git_commit_hash_quietly() -> str | None:
    """lm_eval.loggers.utils.get_git_commit_hash (0.4.13) without git's "fatal: ..." on the terminal."""
    import os

    from lm_eval.loggers.utils import get_commit_from_path

    try:
        return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return get_commit_from_path(os.getcwd())


@contextlib.contextmanager
def quiet_lm_eval() -> Iterator[None]:
    """Within the block, drop only the EXPECTED messages from lm-eval's loggers and git's error line."""
    import lm_eval.evaluator

    loggers = [logging.getLogger(name) for name in LOGGERS]
    for logger in loggers:
        logger.addFilter(_not_expected)
    original = lm_eval.evaluator.get_git_commit_hash  # restored on exit: nothing changes outside the block
    lm_eval.evaluator.get_git_commit_hash = _git_commit_hash_quietly
    try:
        yield
    finally:
        lm_eval.evaluator.get_git_commit_hash = original
        for logger in loggers:
            logger.removeFilter(_not_expected)
