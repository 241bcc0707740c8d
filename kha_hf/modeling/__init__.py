"""The KHA model code. These three files travel with every saved checkpoint as remote code
(`configuration_kha.py`, `modeling_kha.py`, `knocks.py`), so each may import only torch, transformers and its
siblings (single-dot relative imports); `tests/modeling/test_remote_code_rules.py` enforces this for every file here.
This `__init__.py` does not travel (transformers never copies it) but follows the same rule.
"""

from .configuration_kha import DEFAULT_KNOCK, KNOCK_PRESETS, SUPPORTED_BASE_MODEL_TYPES, KHAConfig
from .knocks import KnockLinear, LinearKnock, MLPKnock
from .modeling_kha import KHAForCausalLM, KHAModel, KHAPreTrainedModel

__all__ = [
    "DEFAULT_KNOCK",
    "KNOCK_PRESETS",
    "SUPPORTED_BASE_MODEL_TYPES",
    "KHAConfig",
    "KHAForCausalLM",
    "KHAModel",
    "KHAPreTrainedModel",
    "KnockLinear",
    "LinearKnock",
    "MLPKnock",
]
