"""kha-hf: Knocking-Heads Attention (arXiv 2510.23052) for Hugging Face transformers.

Importing the package registers `KHAConfig` / `KHAModel` / `KHAForCausalLM` with the Auto classes, so KHA
checkpoints load with `AutoModelForCausalLM.from_pretrained(path)` even without `trust_remote_code`.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .common.errors import KHAError
from .common.version import __version__
from .modeling import (
    DEFAULT_KNOCK,
    KNOCK_PRESETS,
    SUPPORTED_BASE_MODEL_TYPES,
    KHAConfig,
    KHAForCausalLM,
    KHAModel,
    KHAPreTrainedModel,
)
from .training.params import (
    count_knock_parameters,
    is_knock_parameter,
    knock_parameter_names,
    knock_target_modules,
    optimizer_param_groups,
)

AutoConfig.register(KHAConfig.model_type, KHAConfig, exist_ok=True)
AutoModel.register(KHAConfig, KHAModel, exist_ok=True)
AutoModelForCausalLM.register(KHAConfig, KHAForCausalLM, exist_ok=True)
# save_pretrained copies configuration_kha.py / modeling_kha.py / knocks.py next to the weights (remote code).
KHAConfig.register_for_auto_class("AutoConfig")
KHAModel.register_for_auto_class("AutoModel")
KHAForCausalLM.register_for_auto_class("AutoModelForCausalLM")

# The tools' Python API, imported on first use (they pull in the Trainer, lm-eval, ...): `from kha_hf import convert`.
_LAZY = {
    "KHATrainer": ".training.trainer",
    "convert": ".conversion.converter",
    "fold": ".conversion.fold",
    "verify_conversion": ".conversion.verify",
    "run_eval": ".eval.compare",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "KHATrainer",
    "convert",
    "fold",
    "run_eval",
    "verify_conversion",
    "knock_target_modules",
    "DEFAULT_KNOCK",
    "KNOCK_PRESETS",
    "SUPPORTED_BASE_MODEL_TYPES",
    "KHAConfig",
    "KHAError",
    "KHAForCausalLM",
    "KHAModel",
    "KHAPreTrainedModel",
    "count_knock_parameters",
    "is_knock_parameter",
    "knock_parameter_names",
    "optimizer_param_groups",
    "__version__",
]
