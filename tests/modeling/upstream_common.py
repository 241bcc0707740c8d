"""transformers' own common model tests (`ModelTesterMixin`), from the published sdist of the installed version.

`load_modeling_common()` takes `tests/test_modeling_common.py` from the sdist of the installed transformers
(`tests/upstream_sdist.py`: downloaded once per version, ~10 MB, into a cache folder) and imports it. The sdist does
not ship two modules that file imports, `tests/exporters/test_export.py` (the base of `ModelTesterMixin`) and
`tests/generation/test_utils.py`; they are replaced by empty mixins, so torch.export and `generate` tests are not run
from here (our own parity tests cover `generate` and the KV cache against the stock model).

`KHA_UPSTREAM_TESTS_CACHE` chooses the cache folder; `KHA_SKIP_UPSTREAM_TESTS=1` skips these tests on a machine
without access to a package index.
"""

from __future__ import annotations

from types import ModuleType

import transformers

from tests.upstream_sdist import import_sdist_tests

PACKAGE = "transformers_upstream_tests"  # our name for the sdist's `tests` package (its imports are relative)
COMMON = "test_modeling_common.py"  # the one file taken from the sdist
STUBS = {  # modules the sdist lacks -> the empty stand-ins of what test_modeling_common imports from them
    "exporters/test_export.py": "class ExportTesterMixin:\n    pass\n",
    "generation/test_utils.py": "class GenerationTesterMixin:\n    pass\n",
}


def load_modeling_common() -> ModuleType:
    """transformers' `tests/test_modeling_common.py` of the installed version, imported; skips only when told to."""
    return import_sdist_tests(
        "transformers", transformers.__version__, [COMMON], PACKAGE, COMMON.removesuffix(".py"), stubs=STUBS
    )
