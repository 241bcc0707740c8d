"""The one exception type the `kha` command reports as a one-line error (anything else is a bug: traceback)."""


class KHAError(Exception):
    """A user-facing error: bad input, an unsupported checkpoint, an unreachable Hub, a failed check."""
