"""Downstream comparison through lm-evaluation-harness, online or with local copies of the eval sets."""

from .compare import run_eval
from .suites import SUITES

__all__ = ["SUITES", "run_eval"]
