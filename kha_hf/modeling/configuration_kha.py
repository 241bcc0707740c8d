"""KHAConfig: a base family's configuration plus the knock settings of Knocking-Heads Attention.

Reference: Zhou et al., "Knocking-Heads Attention", arXiv 2510.23052.

One config class serves every supported base family. It records the family in `base_model_type` and carries
all of that family's fields as attributes; the family's own config class validates them and fills its defaults
(head_dim, layer_types, rope parameters, ...), so a KHA config never disagrees with its base.

This file is copied next to saved checkpoints (remote code): it may import only transformers/torch and siblings.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from transformers import (
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PreTrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

# model_type -> the stock transformers config class of each supported base family
BASE_CONFIG_CLASSES: dict[str, type[PreTrainedConfig]] = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "qwen3_moe": Qwen3MoeConfig,
    "mixtral": MixtralConfig,
}
SUPPORTED_BASE_MODEL_TYPES = tuple(BASE_CONFIG_CLASSES)

KNOCK_TYPES: dict[str, tuple[str, ...]] = {
    "q": ("none", "linear"),
    "k": ("none", "linear"),
    "v": ("none", "linear", "mlp"),
}

# preset name -> (knock_q, knock_k, knock_v); mlp_v is the paper's main (1T-token) setting
KNOCK_PRESETS: dict[str, tuple[str, str, str]] = {
    "mlp_v": ("none", "none", "mlp"),
    "linear_v": ("none", "none", "linear"),
    "linear_qkv": ("linear", "linear", "linear"),
    "mlp_v_linear_qk": ("linear", "linear", "mlp"),
}
DEFAULT_KNOCK = "mlp_v"

# Keys of a config file that describe the file, not the architecture: never taken from a base config.
_FILE_KEYS = {"model_type", "architectures", "auto_map", "transformers_version", "_name_or_path", "_model_name_or_path"}

# Keyword arguments that PreTrainedConfig itself consumes (runtime choices, not architecture): passed through.
_RUNTIME_KEYS = {"attn_implementation", "experts_implementation", "output_attentions", "name_or_path", "num_labels"}

# The fields KHAConfig adds to its base family's.
KHA_FIELDS = ("base_model_type", "knock_q", "knock_k", "knock_v", "knock_layers")

# Remote-code entry points written into every saved KHA config.
AUTO_MAP = {
    "AutoConfig": "configuration_kha.KHAConfig",
    "AutoModel": "modeling_kha.KHAModel",
    "AutoModelForCausalLM": "modeling_kha.KHAForCausalLM",
}


def _attribute_map_union() -> dict[str, str]:
    """Aliases of all supported families (e.g. Mixtral/Qwen3-MoE `num_experts` -> `num_local_experts`)."""
    union: dict[str, str] = {}
    for cls in BASE_CONFIG_CLASSES.values():
        for alias, target in cls.attribute_map.items():
            if union.setdefault(alias, target) != target:
                raise RuntimeError(f"conflicting config alias {alias!r} across base families")
    return union


def _public_class_name(name: str) -> str:
    if name.startswith("KHA") and name.endswith("ForCausalLM"):
        return "KHAForCausalLM"
    if name.startswith("KHA") and name.endswith("Model"):
        return "KHAModel"
    return name


def _knock_tp_plan(config) -> dict[str, str]:
    """Tensor-parallel style of every knock matrix: replicated, gradients all-reduced."""
    parts = {"linear": [""], "mlp": [".up", ".gate", ".down"], "none": []}
    return {
        f"layers.*.self_attn.{target}_knock{part}": "replicated_with_grad_allreduce"
        for target in ("q", "k", "v")
        for part in parts[getattr(config, f"knock_{target}")]
    }


def resolve_knock_preset(knock: str) -> tuple[str, str, str]:
    """Preset name -> (knock_q, knock_k, knock_v), with an error that lists the presets."""
    if knock not in KNOCK_PRESETS:
        raise ValueError(f"unknown knock preset {knock!r}; choose one of: {', '.join(KNOCK_PRESETS)}")
    return KNOCK_PRESETS[knock]


class KHAConfig(PreTrainedConfig):
    r"""
    Configuration of a KHA model: a Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral configuration plus knocks.

    Args:
        base_model_type (`str`, defaults to `"llama"`):
            `model_type` of the base family; its fields (hidden_size, num_attention_heads, ...) are passed as
            keyword arguments and validated by that family's config class.
        knock_q (`str`, defaults to `"none"`): `"none"` or `"linear"`: a shared `head_dim x head_dim` map T^Q on
            every query head, before the q norm and RoPE (paper Eq. for KHA-Linear).
        knock_k (`str`, defaults to `"none"`): same for the key heads (T^K).
        knock_v (`str`, defaults to `"mlp"`): `"none"`, `"linear"` (T^V) or `"mlp"` (KHA-MLP on values:
            `2 * ((V W_up) * sigmoid(V W_gate)) W_down`).
        knock_layers (`list[int]`, *optional*): layer indices that get knocks; all layers when `None`.
        knock (`str`, *optional*): a preset name that sets the three types at once (see `KNOCK_PRESETS`).

    All knocks start as the identity, so a fresh KHA model computes exactly what its base model computes.
    """

    model_type = "kha"
    attribute_map: ClassVar[dict[str, str]] = _attribute_map_union()
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values"]

    base_model_type: str = "llama"
    knock_q: str = "none"
    knock_k: str = "none"
    knock_v: str = "mlp"
    knock_layers: list[int] | None = None
    # Declared here because PreTrainedConfig (5.24) keeps only declared fields: without it `use_cache` from the base
    # config would be dropped, and models would return no KV cache.
    use_cache: bool = True

    def __post_init__(self, **kwargs: Any) -> None:
        if self.base_model_type not in BASE_CONFIG_CLASSES:
            raise ValueError(
                f"unsupported base model type {self.base_model_type!r}; "
                f"KHA supports: {', '.join(SUPPORTED_BASE_MODEL_TYPES)}"
            )
        preset = kwargs.pop("knock", None)
        if preset is not None:
            self.knock_q, self.knock_k, self.knock_v = resolve_knock_preset(preset)
        # The base family's own class validates the architecture fields (the extra keyword arguments) and fills its
        # defaults; its values become attributes here. Fields of this dataclass (dtype, knocks, ...) stay as given.
        own_fields = {f.name for f in dataclasses.fields(self)}
        base = BASE_CONFIG_CLASSES[self.base_model_type](**{k: v for k, v in kwargs.items() if k not in _FILE_KEYS})
        base_values = {k: v for k, v in base.to_dict().items() if k not in _FILE_KEYS and k not in own_fields}
        passthrough = {k: v for k, v in kwargs.items() if k in _RUNTIME_KEYS}
        super().__post_init__(**{**base_values, **passthrough})
        self._validate_knocks()
        self.auto_map = dict(AUTO_MAP)
        # Tensor/pipeline parallelism: the family's plans. Knocks are replicated: under a colwise q/k/v split every
        # rank holds whole heads, and a knock acts on each head's features alone. A rank's knock gradient covers
        # only its heads, so it is summed across ranks (as Qwen3's q/k norms are).
        family = BASE_CONFIG_CLASSES[self.base_model_type]
        self.base_model_tp_plan = {**(family.base_model_tp_plan or {}), **_knock_tp_plan(self)}
        self.base_model_pp_plan = dict(family.base_model_pp_plan or {})

    def _validate_knocks(self) -> None:
        for target, allowed in KNOCK_TYPES.items():
            value = getattr(self, f"knock_{target}")
            if value not in allowed:
                raise ValueError(f"knock_{target}={value!r} is not valid; choose one of: {', '.join(allowed)}")
        if self.knock_layers is not None:
            layers = [int(i) for i in self.knock_layers]
            bad = [i for i in layers if not 0 <= i < self.num_hidden_layers]
            if bad:
                raise ValueError(
                    f"knock_layers {bad} out of range: the model has {self.num_hidden_layers} layers "
                    f"(valid indices 0..{self.num_hidden_layers - 1})"
                )
            self.knock_layers = sorted(set(layers))

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        # save_pretrained records the concrete per-family class (e.g. KHAQwen3ForCausalLM); advertise the public
        # entry points instead, which pick the family from `base_model_type`.
        output["auto_map"] = dict(AUTO_MAP)
        if output.get("architectures"):
            output["architectures"] = [_public_class_name(name) for name in output["architectures"]]
        return output

    def to_diff_dict(self) -> dict[str, Any]:
        output = super().to_diff_dict()
        # Always spell out the family and the knocks, even where they equal the defaults: a reader of config.json
        # (and the converter, fold and inspect tools) should not need to know those defaults.
        for name in KHA_FIELDS:
            output[name] = getattr(self, name)
        return output

    # -- derived views -------------------------------------------------------------------------------------------
    @property
    def knocked_layers(self) -> list[int]:
        """Indices of the layers that carry knocks."""
        if self.knock_layers is None:
            return list(range(self.num_hidden_layers))
        return list(self.knock_layers)

    @property
    def kha_head_dim(self) -> int:
        """Per-head feature size d_h (Qwen2/Mistral configs may leave head_dim unset)."""
        return getattr(self, "head_dim", None) or self.hidden_size // self.num_attention_heads

    @property
    def knock_preset(self) -> str | None:
        """The preset name matching the knock types, or None for a custom combination."""
        types = (self.knock_q, self.knock_k, self.knock_v)
        return next((name for name, value in KNOCK_PRESETS.items() if value == types), None)

    def to_base_config(self) -> PreTrainedConfig:
        """The equivalent stock config of the base family (knock fields dropped)."""
        fields = {k: v for k, v in self.to_dict().items() if k not in KHA_FIELDS and k not in _FILE_KEYS}
        return BASE_CONFIG_CLASSES[self.base_model_type](**fields)

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path: Any, **kwargs: Any) -> tuple[dict, dict]:
        """As in transformers; a base family's config file becomes a KHA config (`knock=`, `knock_layers=`)."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if config_dict.get("model_type") in BASE_CONFIG_CLASSES:
            knock = kwargs.pop("knock", DEFAULT_KNOCK)
            knock_layers = kwargs.pop("knock_layers", None)
            config_dict = cls.from_base(config_dict, knock=knock, knock_layers=knock_layers).to_dict()
        return config_dict, kwargs

    @classmethod
    def from_base(
        cls,
        base_config: PreTrainedConfig | dict[str, Any],
        knock: str | None = DEFAULT_KNOCK,
        knock_layers: list[int] | None = None,
        **knock_types: str,
    ) -> KHAConfig:
        """Build a KHA config from a stock config (object or dict) of a supported family.

        `knock` names a preset; `knock_q` / `knock_k` / `knock_v` keyword arguments override single targets.
        """
        base = base_config if isinstance(base_config, dict) else base_config.to_dict()
        model_type = base.get("model_type")
        if model_type == cls.model_type:
            raise ValueError("this config is already a KHA config")
        if model_type not in BASE_CONFIG_CLASSES:
            raise ValueError(
                f"unsupported base model type {model_type!r}; KHA supports: {', '.join(SUPPORTED_BASE_MODEL_TYPES)}"
            )
        unknown = set(knock_types) - {f"knock_{t}" for t in KNOCK_TYPES}
        if unknown:
            raise TypeError(f"unexpected arguments: {', '.join(sorted(unknown))}")
        fields = {k: v for k, v in base.items() if k not in _FILE_KEYS}
        types = dict(zip(("knock_q", "knock_k", "knock_v"), resolve_knock_preset(knock), strict=True)) if knock else {}
        types.update(knock_types)
        return cls(base_model_type=model_type, knock_layers=knock_layers, **types, **fields)
