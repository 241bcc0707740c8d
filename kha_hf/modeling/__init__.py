"""The KHA model code. These three files travel with every saved checkpoint as remote code
(`configuration_kha.py`, `modeling_kha.py`, `knocks.py`), so each may import only torch, transformers and its
siblings (single-dot relative imports); `tests/modeling/test_remote_code_rules.py` enforces this for every file here.
This `__init__.py` does not travel (transformers never copies it) but follows the same rule.
"""

from .configuration_kha import DEFAULT_KNOCK, KNOCK_PRESETS, SUPPORTED_BASE_MODEL_TYPES, TASK_HEADS, KHAConfig


def __getattr__(name: str):
    # The model classes import transformers' modeling stack (about a second): only when asked for, so that the
    # `kha` command can show its help and check its arguments first.
    if name in ("KHAForCausalLM", "KHAForConditionalGeneration", "KHAModel", "KHAPreTrainedModel", *TASK_HEADS):
        from . import modeling_kha as module
    elif name in ("KnockLinear", "LinearKnock", "MLPKnock"):
        from . import knocks as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(module, name)


__all__ = [
    "DEFAULT_KNOCK",
    "KNOCK_PRESETS",
    "SUPPORTED_BASE_MODEL_TYPES",
    "KHAConfig",
    "KHAForCausalLM",
    "KHAForConditionalGeneration",
    "KHAForQuestionAnswering",
    "KHAForSequenceClassification",
    "KHAForTokenClassification",
    "KHAModel",
    "KHAPreTrainedModel",
    "KnockLinear",
    "LinearKnock",
    "MLPKnock",
]
