"""Knock adapters on peft 0.20 (Axolotl 0.19's pin), which lacks the two tuner hooks peft 0.21 gives a method.

peft >= 0.21 asks the tuner how to name its tensors in the file (`BaseTuner._remove_adapter_name_from_key`) and lets
it check a file before anything loads (`_remap_adapter_state_dict_for_load`): `KnockModel` overrides both. peft 0.20
has neither. Its save strips the adapter name only where it is the second-to-last name, so a knock tensor
`...q_proj.knock_sets.default.q_knock.weight` would keep `.default.` in the file (a file peft 0.21 and any other
adapter name then load nowhere, in silence); its load already inserts the name after the last `knock_` prefix, which
is right for the 0.21 format. So, on peft 0.20 only (`install()` does nothing on 0.21+), and for KNOCK adapters only
(every other method goes through peft's functions untouched):

- `get_peft_model_state_dict` (what `PeftModel.save_pretrained`, Trainer checkpoints and transformers' adapter save
  call) writes the 0.21 file format: the adapter name removed as `KnockModel._remove_adapter_name_from_key` does;
- `set_peft_model_state_dict` (what `PeftModel.from_pretrained` / `load_adapter` call) first runs the same one-line
  checks as 0.21's hook (missing, extra, misshapen, non-finite knocks; tensors outside modules_to_save).

Remove this file once kha-hf's floor is peft 0.21.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import peft
import peft.peft_model
import peft.utils
import peft.utils.save_and_load

from .config import KNOCK_PEFT_TYPE
from .model import REMAP_HOOK, KnockModel, check_knock_state_dict, saved_module_keys

# the modules whose global name peft's own code (and transformers' peft integration, `from peft import ...` at call
# time) looks these functions up under
_HOMES = (peft, peft.utils, peft.utils.save_and_load, peft.peft_model)


def _is_knock(model: Any, adapter_name: str) -> bool:
    config = getattr(model, "peft_config", {}).get(adapter_name)
    return config is not None and getattr(config, "peft_type", None) == KNOCK_PEFT_TYPE  # a str enum


def _saving(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_peft_model_state_dict(model, state_dict=None, adapter_name: str = "default", *args, **kwargs):
        saved = original(model, state_dict, adapter_name, *args, **kwargs)
        if not _is_knock(model, adapter_name):
            return saved
        return {KnockModel._remove_adapter_name_from_key(key, adapter_name): t for key, t in saved.items()}

    get_peft_model_state_dict._kha_compat = True
    return get_peft_model_state_dict


def _loading(original: Callable) -> Callable:
    @functools.wraps(original)
    def set_peft_model_state_dict(model, peft_model_state_dict, adapter_name: str = "default", *args, **kwargs):
        if _is_knock(model, adapter_name):
            # the file's knock keys under the model's names, as peft 0.21's remap gives them to the check
            given = {
                key.replace(".knock_sets.", f".knock_sets.{adapter_name}.", 1): tensor
                for key, tensor in peft_model_state_dict.items()
            }
            saved = saved_module_keys(model, adapter_name, in_file=True)  # peft 0.20 translates them after this
            check_knock_state_dict(model.state_dict(), given, adapter_name, saved)
        return original(model, peft_model_state_dict, adapter_name, *args, **kwargs)

    set_peft_model_state_dict._kha_compat = True
    return set_peft_model_state_dict


def install() -> None:
    """On peft < 0.21: route knock adapters' save and load through the 0.21 file format and checks (idempotent)."""
    if REMAP_HOOK:
        return
    for name, wrap in (("get_peft_model_state_dict", _saving), ("set_peft_model_state_dict", _loading)):
        original = getattr(peft.utils.save_and_load, name)
        if getattr(original, "_kha_compat", False):
            continue
        wrapped = wrap(original)
        for home in _HOMES:
            if getattr(home, name, None) is original:
                setattr(home, name, wrapped)
