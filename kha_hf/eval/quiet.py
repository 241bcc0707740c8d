"""Silence lm-eval warnings that are expected and harmless in kha's use of it, and nothing else.

- `pretrained` model kwarg is not of type `str`, and "Passed an already-initialized model through `pretrained`":
  we hand HFLM a model we loaded ourselves, on purpose, in one process (lm-eval 0.4.13 warns about any such model,
  once per model evaluated).
- "Custom kwargs can be passed to `--metadata`": printed for every task whose documents come from a
  `custom_dataset`, which is how the offline tasks read the local copies.
- "metric X is defined, but aggregation / higher_is_better is not": lm-eval's own YAML for copa (and a few others)
  leaves them to lm-eval's defaults, which it then uses.
Every other warning of lm-eval still shows.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

EXPECTED = (
    "`pretrained` model kwarg is not of type `str`",
    "Passed an already-initialized model through `pretrained`",
    "Custom kwargs can be passed to `--metadata`",
    "is defined, but aggregation is not",
    "is defined, but higher_is_better is not",
)
LOGGERS = ("lm_eval.models.huggingface", "lm_eval.api.task")


class _DropExpected(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in EXPECTED)


@contextlib.contextmanager
def quiet_lm_eval() -> Iterator[None]:
    """Within the block, drop only the EXPECTED messages from lm-eval's loggers."""
    drop = _DropExpected()
    loggers = [logging.getLogger(name) for name in LOGGERS]
    for logger in loggers:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(drop)
