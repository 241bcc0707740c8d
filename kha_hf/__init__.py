"""kha-hf: Knocking-Heads Attention (arXiv 2510.23052) for Hugging Face transformers.

Importing the package registers `KHAConfig` / `KHAModel` / `KHAForCausalLM` with the Auto classes, so KHA
checkpoints load with `AutoModelForCausalLM.from_pretrained(path)` even without `trust_remote_code`, and the
`KNOCK` adapter type with peft, so knock adapters (`KnockConfig`) load with `PeftModel.from_pretrained`.
"""

import sys

from .common.errors import KHAError
from .common.supported_versions import check_transformers
from .common.version import __version__

check_transformers()  # one line below the supported floor, one warning above the newest tested release

from .modeling import DEFAULT_KNOCK, KNOCK_PRESETS, SUPPORTED_BASE_MODEL_TYPES, KHAConfig  # noqa: E402

_registered = False


def register_auto_classes() -> None:
    """Register KHAConfig / KHAModel / KHAForCausalLM with transformers' Auto classes (idempotent; `import kha_hf`
    does it, except under the `kha` command, which parses its arguments first and registers before running)."""
    global _registered
    if _registered:
        return
    from transformers import AutoConfig

    from .modeling.configuration_kha import TASK_HEADS
    from .modeling.modeling_kha import PUBLIC_HEADS, KHAForCausalLM, KHAForConditionalGeneration, KHAModel
    from .modeling.modeling_kha import register_auto_classes as register_model_classes

    AutoConfig.register(KHAConfig.model_type, KHAConfig, exist_ok=True)
    register_model_classes(KHAConfig)  # AutoModel / AutoModelForCausalLM -> KHAModel / KHAForCausalLM
    # save_pretrained copies configuration_kha.py / modeling_kha.py / knocks.py next to the weights (remote code).
    KHAConfig.register_for_auto_class("AutoConfig")
    KHAModel.register_for_auto_class("AutoModel")
    KHAForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    KHAForConditionalGeneration.register_for_auto_class("AutoModelForImageTextToText")  # multimodal models
    for name, head in PUBLIC_HEADS.items():  # reward models, classifiers, extractive QA
        head.register_for_auto_class(TASK_HEADS[name][0])
    from .peft import register_knock_method

    register_knock_method()  # the KNOCK adapter type: PeftModel.from_pretrained(stock, knock_adapter_dir)
    _registered = True


# `kha_hf_entry` (the `kha` console script) defers this until its arguments are parsed: `kha --help` and argument
# errors answer without importing transformers' modeling stack.
if not getattr(sys.modules.get("kha_hf_entry"), "DEFER_REGISTRATION", False):
    register_auto_classes()

# Imported on first use: the model classes, the knock parameter helpers, and the tools' Python API (which pull in
# the Trainer, lm-eval, ...): `from kha_hf import KHAForCausalLM, convert`.
_MODELS = ("KHAForCausalLM", "KHAForConditionalGeneration", "KHAModel", "KHAPreTrainedModel")
_HEADS = ("KHAForSequenceClassification", "KHAForTokenClassification", "KHAForQuestionAnswering")
_PARAMS = ("count_knock_parameters", "is_knock_parameter", "knock_parameter_names", "knock_target_modules")
_LAZY = {
    **dict.fromkeys((*_MODELS, *_HEADS), ".modeling.modeling_kha"),
    **dict.fromkeys((*_PARAMS, "optimizer_param_groups"), ".training.params"),
    "KHATrainer": ".training.trainer",
    "convert": ".conversion.converter",
    "fold": ".conversion.fold",
    "verify_conversion": ".conversion.verify",
    "run_eval": ".eval.compare",
    "KnockConfig": ".peft",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        register_auto_classes()
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_KNOCK",
    "KNOCK_PRESETS",
    "SUPPORTED_BASE_MODEL_TYPES",
    "KHAConfig",
    "KHAError",
    "__version__",
    *_LAZY,
]
