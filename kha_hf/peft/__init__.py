"""Knocks as a PEFT method on stock models: `get_peft_model(model, KnockConfig(knock="linear_qkv"))`.

KHA's knocks (arXiv 2510.23052), identity-initialised and shared by all heads of a layer, as an adapter on any
model of a family KHA supports: `config.py` (KnockConfig), `layer.py` (the wrapped projection), `model.py` (where
the knocks go). Importing kha_hf registers the method with peft, so `PeftModel.from_pretrained(stock, dir)` and
`AutoPeftModelForCausalLM.from_pretrained(dir)` load knock adapters.
"""

from __future__ import annotations

from . import compat
from .config import KNOCK_PEFT_TYPE, KnockConfig, knock_peft_type
from .convert import kha_knock_state_dict, knock_adapter_from_kha, to_kha_model
from .layer import KnockLayer
from .model import KnockModel


def register_knock_method() -> None:
    """Make `KNOCK` a PEFT method (idempotent: registered once, compat installed once)."""
    from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING
    from peft.utils import register_peft_method

    if PEFT_TYPE_TO_TUNER_MAPPING.get(knock_peft_type()) is not KnockModel:
        register_peft_method(
            name=KNOCK_PEFT_TYPE.lower(), config_cls=KnockConfig, model_cls=KnockModel, prefix="knock_"
        )
    compat.install()  # peft 0.20 only: the 0.21 file format and load checks for knock adapters


register_knock_method()

__all__ = [
    "KNOCK_PEFT_TYPE",
    "KnockConfig",
    "KnockLayer",
    "KnockModel",
    "kha_knock_state_dict",
    "knock_adapter_from_kha",
    "register_knock_method",
    "to_kha_model",
]
