"""The releases of transformers kha-hf supports, checked once as `import kha_hf` runs.

The range is the one the test suite passes at both of its ends (README, "Versions tested"): the floor is the
release vLLM's CPU build and Axolotl pin (5.16.1, run in CI's vLLM environment), the top is the newest release CI's
main environment installs. Below the floor kha-hf refuses to import, in one line; above the newest tested minor
release it warns once and goes on (a release that is shown to break gets an upper bound in setup.cfg instead).

This module imports nothing but the standard library: the `kha` command checks the installed release before
transformers' modeling stack is imported.
"""

from __future__ import annotations

import re
import warnings
from importlib import metadata

TRANSFORMERS_FLOOR = "5.16.1"  # = setup.cfg's install_requires and kha_hf.modeling.configuration_kha.MIN_TRANSFORMERS
TRANSFORMERS_TESTED = "5.25"  # the newest minor release the suite has passed on (CI's main environment)


class UnsupportedTransformers(ImportError):
    """The installed transformers is older than kha-hf supports (its message is one line, naming the range)."""


class UntestedTransformersWarning(UserWarning):
    """The installed transformers is newer than any release the suite has passed on."""


def release(text: str) -> tuple[int, ...]:
    """`"5.25.0.dev0"` -> `(5, 25, 0)`: the numeric release of a version string."""
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])


def _below(version: str, floor: str) -> bool:
    """True when VERSION comes before FLOOR by PEP 440 (5.16.1rc1 and 5.16.1.dev0 come before 5.16.1); a string
    packaging cannot read is compared by its numbers."""
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:  # packaging comes with transformers and pip; without it, the numbers
        return release(version) < release(floor)
    try:
        return Version(version) < Version(floor)
    except InvalidVersion:
        return release(version) < release(floor) or not release(version)


def installed_version(distribution: str) -> str | None:
    """The installed version of DISTRIBUTION, or None when it is not installed (read from its metadata, no import)."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def check_transformers(version: str | None = None) -> None:
    """Raise `UnsupportedTransformers` below the floor; warn once (`UntestedTransformersWarning`) above the newest
    tested minor release. VERSION defaults to the installed transformers' (a missing transformers is left to the
    import that needs it)."""
    version = installed_version("transformers") if version is None else version
    if version is None:
        return
    if _below(version, TRANSFORMERS_FLOOR):
        raise UnsupportedTransformers(
            f"kha-hf supports transformers>={TRANSFORMERS_FLOOR} (tested up to {TRANSFORMERS_TESTED}); installed: "
            f"{version}: pip install 'transformers>={TRANSFORMERS_FLOOR}'"
        )
    if release(version)[:2] > release(TRANSFORMERS_TESTED)[:2]:
        warnings.warn(
            f"kha-hf is tested with transformers {TRANSFORMERS_FLOOR} to {TRANSFORMERS_TESTED}.x; {version} is newer: "
            "please report what breaks",
            UntestedTransformersWarning,
            stacklevel=3,
        )


def require(distribution: str, minimum: str, what: str) -> None:
    """KHAError (one line) unless DISTRIBUTION is installed at MINIMUM or newer; WHAT says what needs it."""
    from .errors import KHAError

    found = installed_version(distribution)
    if found is None or _below(found, minimum):
        raise KHAError(
            f"{what} needs {distribution}>={minimum}, installed: {found or 'none'}: "
            f"pip install '{distribution}>={minimum}'"
        )


# lm-eval 0.4.11 (Axolotl 0.19's pin) lacks the task loader kha eval reads lm-eval's own task YAML with
# (lm_eval.tasks._yaml_loader) and its TaskManager entries are plain dicts
LM_EVAL_FLOOR = "0.4.13"


def versions_line() -> str:
    """`kha-hf 0.5.0 (transformers 5.25.0, torch 2.13.0+cpu, peft 0.21.2)`: what `kha --version` prints."""
    from .version import __version__

    parts = [f"{name} {installed_version(name) or 'not installed'}" for name in ("transformers", "torch", "peft")]
    return f"kha-hf {__version__} ({', '.join(parts)})"
