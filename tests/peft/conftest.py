"""Knock adapters need peft >= 0.21 (kha_hf/peft/model.py, REMAP_HOOK); kha-hf itself runs from peft 0.20 (Axolotl
0.19's pin, CI's low end). There the tests of this folder skip with that reason, except the one that checks the
refusal itself (test_knock_adapters_refuse_an_old_peft_in_one_line)."""

from __future__ import annotations

import peft
import pytest

from kha_hf.peft.model import REMAP_HOOK

OLD_PEFT = f"knock adapters need peft>=0.21; this is {peft.__version__} (kha_hf/peft/model.py refuses it in one line)"


def pytest_collection_modifyitems(config, items):
    if REMAP_HOOK:
        return
    for item in items:
        if "/tests/peft/" in str(item.path) and "refuse_an_old_peft" not in item.name:
            item.add_marker(pytest.mark.skip(reason=OLD_PEFT))
