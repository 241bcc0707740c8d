"""KHAConfig: a base family's configuration plus the knock settings of Knocking-Heads Attention.

Reference: Zhou et al., "Knocking-Heads Attention", arXiv 2510.23052.

One config class serves every base family (`families.py`). It records the family in `base_model_type` and carries
all of that family's fields as attributes; the family's own config class validates them and fills its defaults
(head_dim, layer_types, rope parameters, ...), so a KHA config never disagrees with its base. The family's
attribute aliases (e.g. Mixtral's `num_experts` -> `num_local_experts`) hold per instance: families alias the same
names differently (DeepSeek-V3 maps `num_local_experts` on to `n_routed_experts`).

This file is copied next to saved checkpoints (remote code): it may import only transformers/torch and siblings.
"""

from __future__ import annotations

import dataclasses
import numbers
import re
from typing import Any, ClassVar

import transformers
from transformers import PreTrainedConfig

from .families import (
    FAMILIES,
    SUPPORTED_BASE_MODEL_TYPES,
    attention_layers,
    family_spec,
    knock_dims,
)

# The oldest transformers this remote-code set runs on (tested: the vLLM environment of scripts/install.sh vllm pins
# it); kha-hf itself needs the newer range in setup.cfg.
MIN_TRANSFORMERS = "5.16.1"


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


if _release(transformers.__version__) < _release(MIN_TRANSFORMERS):
    raise ImportError(
        f"KHA models need transformers >= {MIN_TRANSFORMERS}, this is {transformers.__version__}: "
        f"pip install 'transformers>={MIN_TRANSFORMERS}'"
    )


def multimodal_text_type(model_type: str | None) -> str | None:
    """`None` unless MODEL_TYPE is a multimodal wrapper around a text decoder (an image-text-to-text model whose
    config has a `text_config`: gemma3, qwen2_5_vl, mistral3, idefics3, ...); then the model_type of its default text
    decoder (a checkpoint's own `text_config.model_type` is what counts: `KHAConfig.knock_config`)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    if not isinstance(model_type, str) or model_type in FAMILIES:
        return None
    if model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES or model_type not in CONFIG_MAPPING:
        return None
    family = CONFIG_MAPPING[model_type]
    spec = (getattr(family, "sub_configs_defaults", None) or {}).get("text_config")
    if spec is not None:  # transformers >= 5.24
        return getattr(spec.config_class, "model_type", None) or spec.model_type or ""
    text_class = family.sub_configs.get("text_config")  # older 5.x: the class only ("" when it is AutoConfig)
    return None if text_class is None else getattr(text_class, "model_type", "") or ""


def base_config_class(model_type: str | None) -> type[PreTrainedConfig]:
    """transformers' config class of a base family or of a multimodal wrapper around one; ValueError naming the
    supported ones otherwise."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    if model_type in FAMILIES:
        return CONFIG_MAPPING[model_type]
    if multimodal_text_type(model_type) is not None:
        return CONFIG_MAPPING[model_type]  # its text decoder is checked where the knocks are made (knock_config)
    decoder = model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or model_type in MODEL_MAPPING_NAMES
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING and decoder:
        # A family the table does not list is tried with the standard layout: it must at least name its sizes as
        # the standard families do (its attention code is checked when a model is built: modeling_kha). Text
        # decoders that live only inside a multimodal model (qwen2_5_vl_text: a body, no causal LM) come this way.
        family = CONFIG_MAPPING[model_type]
        names = {f.name for f in dataclasses.fields(family)} if dataclasses.is_dataclass(family) else set()
        if {"hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads"} <= names:
            return family
        raise ValueError(
            f"unsupported base model type {model_type!r}: it does not name its attention sizes as the decoders KHA "
            "knocks do "
            "(hidden_size, num_attention_heads, num_key_value_heads: an older decoder, or a vision, audio or encoder "
            f"model); KHA supports: {', '.join(SUPPORTED_BASE_MODEL_TYPES)} and multimodal models around them "
            "(gemma3, qwen2_5_vl, mistral3, idefics3, ...)"
        )
    raise ValueError(
        f"unsupported base model type {model_type!r}; KHA supports: {', '.join(SUPPORTED_BASE_MODEL_TYPES)} and "
        "multimodal models around them (gemma3, qwen2_5_vl, mistral3, idefics3, ...)"
    )


KNOCK_TYPES: dict[str, tuple[str, ...]] = {
    "q": ("none", "linear", "mlp"),
    "k": ("none", "linear", "mlp"),
    "v": ("none", "linear", "mlp", "gate"),  # gate: the paper's "gate alone on V" control (from-scratch A/B only)
}
TARGET_WORDS = {"q": "query", "k": "key", "v": "value"}
# Knock types that are not one matrix: no fold into a projection, no GGUF, no PEFT merge
NONLINEAR_TYPES = ("mlp", "gate")
# Knock types of the paper's controls: a model with one is for comparison, never converted, folded or adapted
CONTROL_TYPES = ("gate",)
KNOCK_INITS = ("identity", "random")  # random: the paper's Sec. 3.3 control (from-scratch A/B only)

# preset name -> (knock_q, knock_k, knock_v); mlp_v is the paper's main (1T-token) setting. The rest are the rows of
# its ablation table (75B tokens, A0.8B-6.6B MoE): Linear Q/K/V/QKV, MLP Q/K/V/QKV, and the gate-alone control.
KNOCK_PRESETS: dict[str, tuple[str, str, str]] = {
    "mlp_v": ("none", "none", "mlp"),
    "linear_v": ("none", "none", "linear"),
    "linear_qkv": ("linear", "linear", "linear"),
    "mlp_v_linear_qk": ("linear", "linear", "mlp"),
    "linear_q": ("linear", "none", "none"),
    "linear_k": ("none", "linear", "none"),
    "mlp_q": ("mlp", "none", "none"),
    "mlp_k": ("none", "mlp", "none"),
    "mlp_qkv": ("mlp", "mlp", "mlp"),
    "gate_v": ("none", "none", "gate"),
}
DEFAULT_KNOCK = "mlp_v"
# presets of the paper's controls (gate_v): for from-scratch comparisons, never converted or adapted
CONTROL_PRESETS = tuple(name for name, types in KNOCK_PRESETS.items() if set(types) & set(CONTROL_TYPES))


def mlp_knocks_phrase(targets: list[str]) -> str:
    """'the value knock is an MLP' / 'the query/key knocks are MLPs': the subject of every refusal of a non-linear
    knock (fold, GGUF)."""
    words = "/".join(TARGET_WORDS[t] for t in targets)
    return f"the {words} knock{'s are MLPs' if len(targets) > 1 else ' is an MLP'}"


# Keys of a config file that describe the file, not the architecture: never taken from a base config.
_FILE_KEYS = {"model_type", "architectures", "auto_map", "transformers_version", "_name_or_path", "_model_name_or_path"}

# Keyword arguments that PreTrainedConfig itself consumes (runtime choices, not architecture): passed through.
_RUNTIME_KEYS = {"attn_implementation", "experts_implementation", "output_attentions", "name_or_path", "num_labels"}

# The fields KHAConfig adds to its base family's.
KHA_FIELDS = ("base_model_type", "knock_q", "knock_k", "knock_v", "knock_layers", "knock_init")

# Remote-code entry points written into every saved KHA config (plus the task heads its family has: `auto_map_for`).
AUTO_MAP = {
    "AutoConfig": "configuration_kha.KHAConfig",
    "AutoModel": "modeling_kha.KHAModel",
    "AutoModelForCausalLM": "modeling_kha.KHAForCausalLM",
}

# Task heads (reward models, classifiers, extractive QA): KHA's public class -> (transformers' Auto class, the name of
# the Auto mapping that lists each family's own head class). A family has the heads its transformers code has.
TASK_HEADS: dict[str, tuple[str, str]] = {
    "KHAForSequenceClassification": (
        "AutoModelForSequenceClassification",
        "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    ),
    "KHAForTokenClassification": ("AutoModelForTokenClassification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"),
    "KHAForQuestionAnswering": ("AutoModelForQuestionAnswering", "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES"),
}


def family_heads(model_type: str | None) -> dict[str, str]:
    """KHA head class name -> the family's own transformers class name, for the heads MODEL_TYPE has (none for a
    multimodal model: its heads are not tested here, so a checkpoint with one is refused rather than guessed)."""
    from transformers.models.auto import modeling_auto

    heads = {}
    if multimodal_text_type(model_type) is not None:
        return heads
    for public, (_, mapping) in TASK_HEADS.items():
        name = getattr(modeling_auto, mapping, {}).get(model_type)
        if isinstance(name, str):
            heads[public] = name
    return heads


def auto_map_for(model_type: str | None) -> dict[str, str]:
    """The remote-code entry points of a KHA config of MODEL_TYPE: the model, the causal LM and the family's heads."""
    entries = dict(AUTO_MAP)
    if multimodal_text_type(model_type) is not None:  # image-text-to-text: the family's ...ForConditionalGeneration
        entries["AutoModelForImageTextToText"] = "modeling_kha.KHAForConditionalGeneration"
    for public in family_heads(model_type):
        entries[TASK_HEADS[public][0]] = f"modeling_kha.{public}"
    return entries


def kha_architecture(architectures: list[str] | None, model_type: str | None) -> str:
    """The KHA class for a base checkpoint whose config lists ARCHITECTURES: its task head, else the causal LM.

    ValueError for an architecture of the family that KHA has no class for (its head would be dropped).
    """
    names = [name for name in architectures or [] if isinstance(name, str)]
    heads = family_heads(model_type)
    named = sorted({public for public, family_name in heads.items() if family_name in names})
    if len(named) > 1:
        raise ValueError(
            f"its architectures name two different heads ({', '.join(named)}): which one do the weights hold?"
        )
    if named:
        return named[0]
    from transformers.models.auto import modeling_auto

    multimodal = multimodal_text_type(model_type) is not None  # an image-text-to-text model (no task heads)
    models = (
        modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
        if multimodal
        else modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    )
    known = {models.get(model_type), modeling_auto.MODEL_MAPPING_NAMES.get(model_type)}
    unknown = [name for name in names if name not in known]
    if unknown:
        what = "an image-text-to-text model" if multimodal else "a causal LM or a task head"
        raise ValueError(
            f"its architecture {unknown[0]} is not {what} KHA has for {model_type} "
            f"({', '.join([*sorted(n for n in known if n), *heads.values()])}): converting it would drop its head"
        )
    return "KHAForConditionalGeneration" if multimodal else "KHAForCausalLM"


def _public_class_name(name: str) -> str:
    if not name.startswith("KHA"):
        return name
    for public in ("KHAForCausalLM", "KHAForConditionalGeneration", *TASK_HEADS):
        if name.endswith(public.removeprefix("KHA")):
            return public
    if name.endswith("Model"):
        return "KHAModel"
    return name


# Tensor parallelism: the knock of a projection split by heads ("colwise": each rank holds whole heads and sees only
# their features) gets gradients from a part of the heads on each rank, summed across ranks (as Qwen3's q/k norms
# are); the knock of a projection whose output is gathered ("colwise_gather_output": every rank sees every head)
# already has the whole gradient on each rank, and summing would multiply it by the number of ranks.
KNOCK_TP_STYLE = {
    "colwise": "replicated_with_grad_allreduce",
    "colwise_gather_output": "replicate",
    "colwise_rep": "replicate",
}


# The parallel plans a family's config class carries besides `base_model_tp_plan` / `base_model_pp_plan`, in the
# transformers releases that have them (5.25: `DistributedConfig(ep_size=...)` reads the expert plan).
_PLANS_OF_NEWER_RELEASES = ("base_model_ep_plan", "base_model_fsdp_plan")


def _knock_tp_plan(config, family_plan: dict[str, str]) -> dict[str, str]:
    """Tensor-parallel style of every knock matrix, following the style of the projection it follows."""
    parts = {"linear": [""], "mlp": [".up", ".gate", ".down"], "gate": [".gate"], "none": []}
    layout = family_spec(config.base_model_type).layout
    plan = {}
    for projection, blocks in layout.items():
        style = KNOCK_TP_STYLE.get(family_plan.get(f"layers.*.self_attn.{projection}", ""))
        targets = {s.target for b in blocks for s in b.segments if s.target is not None}
        for target in sorted(targets):
            for part in parts[getattr(config, f"knock_{target}")]:
                if style is not None:
                    plan.setdefault(f"layers.*.self_attn.{target}_knock{part}", style)
    return plan


def _is_base_family(model_type: str) -> bool:
    try:
        base_config_class(model_type)
    except ValueError:
        return False
    return True


def control_refusal(what: str, tool: str) -> str:
    """The one-line refusal of a control model (gate-only, random init: WHAT says which) by TOOL."""
    return (
        f"{what}: one of the paper's controls, which exist to be compared against in from-scratch runs "
        f"(kha ab --variants gate_v,mlp_v_random); {tool} takes the paper's knocks only (mlp_v, linear_v, ...)"
    )


def resolve_knock_preset(knock: str) -> tuple[str, str, str]:
    """Preset name -> (knock_q, knock_k, knock_v), with an error that lists the presets."""
    if knock not in KNOCK_PRESETS:
        raise ValueError(f"unknown knock preset {knock!r}; choose one of: {', '.join(KNOCK_PRESETS)}")
    return KNOCK_PRESETS[knock]


class _FamilySubConfigs:
    """`KHAConfig.sub_configs`: none on the class, the base family's on an instance (a multimodal model's
    text_config / vision_config). transformers walks them to give every sub-model the attention implementation."""

    def __get__(self, obj: Any, owner: type) -> dict[str, type]:
        if obj is None:
            return {}
        family = base_config_class(obj.base_model_type)
        return {key: cls for key, cls in family.sub_configs.items() if getattr(obj, key, None) is not None}


class KHAConfig(PreTrainedConfig):
    r"""
    Configuration of a KHA model: the configuration of a base family (Llama, Qwen, Gemma, Phi-3, OLMo, GPT-OSS,
    DeepSeek-V3, ...: see `families.FAMILIES`) plus knocks.

    Args:
        base_model_type (`str`, defaults to `"llama"`):
            `model_type` of the base family; its fields (hidden_size, num_attention_heads, ...) are passed as
            keyword arguments and validated by that family's config class.
        knock_q (`str`, defaults to `"none"`): `"none"`, `"linear"`: a shared `head_dim x head_dim` map T^Q on
            every query head, before the q norm and RoPE (paper Eq. for KHA-Linear), or `"mlp"` (the paper's
            MLP-on-Q ablation row, at the same place).
        knock_k (`str`, defaults to `"none"`): same for the key heads (T^K).
        knock_v (`str`, defaults to `"mlp"`): `"none"`, `"linear"` (T^V), `"mlp"` (KHA-MLP on values:
            `2 * ((V W_up) * sigmoid(V W_gate)) W_down`) or `"gate"` (the paper's control `2 * (V * sigmoid(V W_gate))`,
            for from-scratch comparisons only).
        knock_layers (`list[int]`, *optional*): layer indices that get knocks; all layers when `None`.
        knock_init (`str`, defaults to `"identity"`): `"random"` draws every knock at random (nn.Linear's init) instead
            of the identity: the paper's Sec. 3.3 control, for from-scratch comparisons only.
        knock (`str`, *optional*): a preset name that sets the three types at once (see `KNOCK_PRESETS`).

    All knocks start as the identity, so a fresh KHA model computes exactly what its base model computes.
    """

    model_type = "kha"
    attribute_map: ClassVar[dict[str, str]] = {}  # each instance holds its family's (see __post_init__)
    sub_configs = _FamilySubConfigs()
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values"]

    base_model_type: str = "llama"
    knock_q: str = "none"
    knock_k: str = "none"
    knock_v: str = "mlp"
    knock_layers: list[int] | None = None
    knock_init: str = "identity"
    # Declared here because PreTrainedConfig (5.24) keeps only declared fields: without it `use_cache` from the base
    # config would be dropped, and models would return no KV cache.
    use_cache: bool = True

    def __post_init__(self, **kwargs: Any) -> None:
        family = base_config_class(self.base_model_type)
        # The family's aliases, for this instance only (PreTrainedConfig reads `attribute_map` through the instance)
        object.__setattr__(self, "attribute_map", dict(family.attribute_map))
        preset = kwargs.pop("knock", None)
        if preset is not None:
            wanted = resolve_knock_preset(preset)
            given = (self.knock_q, self.knock_k, self.knock_v)
            defaults = ("none", "none", "mlp")  # the fields' defaults: a value other than these was given
            clash = [
                f"knock_{t}={g!r}" for t, g, d, w in zip("qkv", given, defaults, wanted, strict=True) if g not in (d, w)
            ]
            if clash:
                raise ValueError(
                    f"knock={preset!r} means knock_q/k/v = {'/'.join(wanted)}, but {', '.join(clash)} was given too: "
                    "give the preset or the three types, not both"
                )
            self.knock_q, self.knock_k, self.knock_v = wanted
        # The base family's own class validates the architecture fields (the extra keyword arguments) and fills its
        # defaults; its values become attributes here. Fields of this dataclass (dtype, knocks, ...) stay as given.
        own_fields = {f.name for f in dataclasses.fields(self)}
        for key in family.sub_configs:  # else the family's strict dataclass answers in a multi-line report
            value = kwargs.get(key)
            if value is not None and not isinstance(value, (dict, PreTrainedConfig)):
                raise ValueError(f"{key} must be an object (the sub-model's config), got {str(value)[:40]!r}")
        base = family(**{k: v for k, v in kwargs.items() if k not in _FILE_KEYS})
        base_values = {k: v for k, v in base.to_dict().items() if k not in _FILE_KEYS and k not in own_fields}
        # A multimodal model's sub-configs stay the family's config objects (its code reads config.text_config.x)
        base_values.update({key: getattr(base, key) for key in family.sub_configs if key in base_values})
        passthrough = {k: v for k, v in kwargs.items() if k in _RUNTIME_KEYS}
        super().__post_init__(**{**base_values, **passthrough})
        self._validate_knocks()
        self.auto_map = auto_map_for(self.base_model_type)
        # transformers 5.24's `_get_model_class` (auto_factory.py) iterates `config.architectures` whenever the Auto
        # mapping holds a tuple of classes, which ours does (the public class, then each family's): a fresh config's
        # `None` made `AutoModelForCausalLM.from_config` raise TypeError. An empty list means the same (no preference:
        # the mapping's first class) and iterates; `to_dict` writes it back as `null`. Remove when upstream reads
        # `getattr(config, "architectures", None) or []` (tests/modeling/test_auto_from_config.py turns red then).
        if self.architectures is None:
            self.architectures = []
        # Tensor/pipeline parallelism: the family's plans. Knocks are replicated: under a colwise q/k/v split every
        # rank holds whole heads, and a knock acts on each head's features alone. A rank's knock gradient covers
        # only its heads, so it is summed across ranks (as Qwen3's q/k norms are).
        family_plan = dict(family.base_model_tp_plan or {})
        knocks_plan = {} if self.is_multimodal else _knock_tp_plan(self, family_plan)
        self.base_model_tp_plan = {**family_plan, **knocks_plan}
        self.base_model_pp_plan = dict(family.base_model_pp_plan or {})
        # Expert parallelism and FSDP2 (transformers >= 5.2x, `DistributedConfig`): the family's plans as they are.
        # Knocks live inside each decoder layer (`layers.*`), so FSDP2 shards them with their layer; an MoE's experts
        # keep the family's expert plan. Older releases have neither attribute.
        for name in _PLANS_OF_NEWER_RELEASES:
            if getattr(family, name, None):
                object.__setattr__(self, name, dict(getattr(family, name)))

    def _validate_knocks(self) -> None:
        for target, allowed in KNOCK_TYPES.items():
            value = getattr(self, f"knock_{target}")
            if value not in allowed:
                raise ValueError(f"knock_{target}={value!r} is not valid; choose one of: {', '.join(allowed)}")
        if self.knock_init not in KNOCK_INITS:
            raise ValueError(f"knock_init={self.knock_init!r} is not valid; choose one of: {', '.join(KNOCK_INITS)}")
        if self.is_multimodal:
            self.knock_layers = self.knock_config.knock_layers  # the text decoder's config validates them
            return
        spec = family_spec(self.base_model_type)
        nonlinear = [f"knock_{t}={k!r}" for t, k in zip("qkv", self.knock_types, strict=True) if k in NONLINEAR_TYPES]
        if spec.linear_only and nonlinear:
            raise ValueError(
                f"{self.base_model_type} uses multi-head latent attention (MLA), which takes linear knocks only "
                f"(linear_q, linear_k, linear_v, linear_qkv), not {nonlinear[0]}: a linear knock is absorbed into the "
                "latent projections, an MLP or gate is not (the paper runs KHA-Linear on MLA)"
            )
        knock_dims(self, spec.layout)  # every knocked size is a positive integer
        if self.knock_layers is not None:
            odd = [i for i in self.knock_layers if isinstance(i, bool) or not isinstance(i, numbers.Integral)]
            if odd:  # int(True) or int("3") would pass for a layer index
                raise ValueError(f"knock_layers must be layer indices (integers), got {odd[0]!r}")
            layers = [int(i) for i in self.knock_layers]
            bad = [i for i in layers if not 0 <= i < self.num_hidden_layers]
            if bad:
                raise ValueError(
                    f"knock_layers {bad} out of range: the model has {self.num_hidden_layers} layers "
                    f"(valid indices 0..{self.num_hidden_layers - 1})"
                )
            without = sorted(set(layers) - set(attention_layers(self)))
            if without:
                raise ValueError(f"knock_layers {without} have no softmax attention (their layer_types) to knock")
            self.knock_layers = sorted(set(layers))

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        output.pop("attribute_map", None)  # the family's aliases: rebuilt from base_model_type
        for name in _PLANS_OF_NEWER_RELEASES:  # class-level plans in the family: never written to config.json
            output.pop(name, None)
        # save_pretrained records the concrete per-family class (e.g. KHAQwen3ForCausalLM); advertise the public
        # entry points instead, which pick the family from `base_model_type`.
        output["auto_map"] = auto_map_for(self.base_model_type)
        if output.get("architectures"):
            output["architectures"] = [_public_class_name(name) for name in output["architectures"]]
        else:
            output["architectures"] = None  # see __post_init__: `[]` is only the in-memory stand-in for "unset"
        return output

    def to_diff_dict(self) -> dict[str, Any]:
        output = super().to_diff_dict()
        output.pop("attribute_map", None)
        # Always spell out the family and the knocks, even where they equal the defaults: a reader of config.json
        # (and the converter, fold and inspect tools) should not need to know those defaults.
        for name in KHA_FIELDS:
            output[name] = getattr(self, name)
        if self.knock_init == "identity":
            output.pop("knock_init")  # the default, and what every checkpoint before it meant: written only when not
        return output

    # -- derived views -------------------------------------------------------------------------------------------
    @property
    def is_multimodal(self) -> bool:
        """True for a multimodal model (gemma3, qwen2_5_vl, ...): the knocks act in its text decoder only."""
        return multimodal_text_type(self.base_model_type) is not None

    @property
    def knock_config(self) -> KHAConfig:
        """The config the knocks are made from: this one, or for a multimodal model a KHA config of its text decoder
        (`text_config`) with this config's knocks. ValueError when that decoder is not one KHA can knock."""
        if not self.is_multimodal:
            return self
        text = self.text_config
        text_type = getattr(text, "model_type", None)
        # a wrapper nested in a wrapper (text_config naming gemma3, mistral3, ...) or a KHA config is no text decoder
        nested = text_type in (self.model_type, "kha") or multimodal_text_type(text_type) is not None
        if nested or not _is_base_family(text_type):
            raise ValueError(
                f"the text decoder of this {self.base_model_type} model is {text_type!r}, which KHA does not support; "
                f"KHA supports: {', '.join(SUPPORTED_BASE_MODEL_TYPES)}"
            )
        types = {f"knock_{t}": getattr(self, f"knock_{t}") for t in KNOCK_TYPES}
        types["knock_init"] = self.knock_init
        return KHAConfig.from_base(text, knock=None, knock_layers=self.knock_layers, **types)

    @property
    def knocked_layers(self) -> list[int]:
        """Indices of the text decoder's layers that carry knocks (only layers with softmax attention, in hybrid
        models)."""
        if self.is_multimodal:
            return self.knock_config.knocked_layers
        if self.knock_layers is None:
            return attention_layers(self)
        return list(self.knock_layers)

    @property
    def knock_dims(self) -> dict[str, int]:
        """target (q / k / v) -> the size of the per-head features its knock acts on (d_h; MLA: its no-RoPE part)."""
        if self.is_multimodal:
            return self.knock_config.knock_dims
        return knock_dims(self, family_spec(self.base_model_type).layout)

    @property
    def kha_head_dim(self) -> int:
        """Per-head feature size of the value knock (d_h for every family but MLA); see `knock_dims`."""
        return self.knock_dims["v"]

    @property
    def knock_types(self) -> tuple[str, str, str]:
        """(knock_q, knock_k, knock_v)."""
        return (self.knock_q, self.knock_k, self.knock_v)

    @property
    def control_knocks(self) -> str | None:
        """None for a model made of the paper's knocks; else what makes it one of its controls, in words (a gate-only
        value knock, random initialisation): such a model exists to be compared against, never converted."""
        if set(self.knock_types) & set(CONTROL_TYPES):
            return "its value knock is the gate-only control (gate_v)"
        if self.knock_init == "random":
            return "its knocks were initialised at random (knock_init='random')"
        return None

    @property
    def nonlinear_targets(self) -> list[str]:
        """The targets (q / k / v) whose knock is not one matrix (an MLP or the gate): no fold, merge or GGUF."""
        return [t for t, kind in zip("qkv", self.knock_types, strict=True) if kind in NONLINEAR_TYPES]

    @property
    def knock_preset(self) -> str | None:
        """The preset name matching the knock types, or None for a custom combination."""
        types = (self.knock_q, self.knock_k, self.knock_v)
        return next((name for name, value in KNOCK_PRESETS.items() if value == types), None)

    def to_base_config(self) -> PreTrainedConfig:
        """The equivalent stock config of the base family (knock fields dropped)."""
        fields = {k: v for k, v in self.to_dict().items() if k not in KHA_FIELDS and k not in _FILE_KEYS}
        return base_config_class(self.base_model_type)(**fields)

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path: Any, **kwargs: Any) -> tuple[dict, dict]:
        """As in transformers; a base family's config file becomes a KHA config (`knock=`, `knock_layers=`)."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if config_dict.get("model_type") not in (cls.model_type, None) and _is_base_family(config_dict["model_type"]):
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

        Args:
            base_config: the stock config, e.g. `Qwen3Config(...)` or `AutoConfig.from_pretrained(...).to_dict()`.
            knock: a preset of `kha_hf.KNOCK_PRESETS` (default `mlp_v`), or `None` for the fields' defaults.
            knock_layers: the layer indices to knock (default: every softmax-attention layer).
            **knock_types: `knock_q=`, `knock_k=`, `knock_v=`: `"none"`, `"linear"` or `"mlp"` (`"gate"` on v);
                `knock_init=`: `"identity"` (default) or `"random"`.

        Returns:
            A `KHAConfig` with every field of the base config and `base_model_type` set to its `model_type`.

        Raises:
            ValueError: the config is a KHA config already, its family is not supported (the message names the
                supported ones), or the knocks do not fit it (an MLP knock on MLA).
            TypeError: a keyword other than `knock_q`, `knock_k`, `knock_v`, `knock_init`.
        """
        base = base_config if isinstance(base_config, dict) else base_config.to_dict()
        model_type = base.get("model_type")
        if model_type == cls.model_type:
            raise ValueError("this config is already a KHA config")
        base_config_class(model_type)  # ValueError naming the supported families
        unknown = set(knock_types) - {f"knock_{t}" for t in KNOCK_TYPES} - {"knock_init"}
        if unknown:
            raise TypeError(f"unexpected arguments: {', '.join(sorted(unknown))}")
        fields = {k: v for k, v in base.items() if k not in _FILE_KEYS}
        types = dict(zip(("knock_q", "knock_k", "knock_v"), resolve_knock_preset(knock), strict=True)) if knock else {}
        types.update(knock_types)
        return cls(base_model_type=model_type, knock_layers=knock_layers, **types, **fields)
