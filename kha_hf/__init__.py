"""kha-hf: Knocking-Heads Attention (arXiv 2510.23052) for Hugging Face transformers.

Importing the package registers `KHAConfig` / `KHAModel` / `KHAForCausalLM` with the Auto classes, so KHA
checkpoints load with `AutoModelForCausalLM.from_pretrained(path)` even without `trust_remote_code`.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .common.errors import KHAError
from .modeling import (
    DEFAULT_KNOCK,
    KNOCK_PRESETS,
    SUPPORTED_BASE_MODEL_TYPES,
    KHAConfig,
    KHAForCausalLM,
    KHAModel,
    KHAPreTrainedModel,
)
from .training.params import count_knock_parameters, is_knock_parameter, knock_parameter_names, optimizer_param_groups

__version__ = "0.1.0"

AutoConfig.register(KHAConfig.model_type, KHAConfig, exist_ok=True)
AutoModel.register(KHAConfig, KHAModel, exist_ok=True)
AutoModelForCausalLM.register(KHAConfig, KHAForCausalLM, exist_ok=True)
# save_pretrained copies configuration_kha.py / modeling_kha.py / knocks.py next to the weights (remote code).
KHAConfig.register_for_auto_class("AutoConfig")
KHAModel.register_for_auto_class("AutoModel")
KHAForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = [
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
