"""Checkpoint surgery: convert base checkpoints to KHA, verify them, fold KHA-Linear back, inspect knocks."""

from .converter import ConversionResult, convert
from .verify import verify_conversion

__all__ = ["ConversionResult", "convert", "verify_conversion"]
