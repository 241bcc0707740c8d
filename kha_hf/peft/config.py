"""`KnockConfig`: the PEFT config of the knock adapter (KHA's knocks on a stock model, arXiv 2510.23052)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peft.config import PeftConfig
from peft.utils import PeftType

from ..modeling.configuration_kha import CONTROL_TYPES, DEFAULT_KNOCK, KNOCK_PRESETS, KNOCK_TYPES, control_refusal

KNOCK_PEFT_TYPE = "KNOCK"  # the adapter type in adapter_config.json; transformers keys adapters by its lower case
MAX_KNOCK_LAYERS = 100_000  # far beyond any model; bounds a hostile adapter_config.json before anything is built


def knock_peft_type() -> PeftType:
    """`PeftType.KNOCK`, added on first use.

    peft 0.21's `register_peft_method` accepts only names that are members of its `PeftType` enum and documents no
    other way for a method that lives outside peft. Adding one member (`KNOCK`) is the smallest step that lets the
    public registration run; no existing member or mapping changes. Remove once peft lets out-of-tree methods
    register a type of their own.
    """
    member = PeftType.__members__.get(KNOCK_PEFT_TYPE)
    if member is not None:
        return member
    member = str.__new__(PeftType, KNOCK_PEFT_TYPE)
    member._name_ = member._value_ = KNOCK_PEFT_TYPE
    member.__objclass__ = PeftType
    if hasattr(enum.Enum, "_sort_order_"):
        member._sort_order_ = len(PeftType._member_names_)
    PeftType._member_map_[KNOCK_PEFT_TYPE] = member
    PeftType._value2member_map_[KNOCK_PEFT_TYPE] = member
    PeftType._member_names_.append(KNOCK_PEFT_TYPE)
    type.__setattr__(PeftType, KNOCK_PEFT_TYPE, member)
    return member


@dataclass
class KnockConfig(PeftConfig):
    """Configuration of a knock adapter: KHA's knocks, shared by all heads of a layer and identity-initialised, on
    the q/k/v projections of a stock model of any family KHA supports (`kha_hf.SUPPORTED_BASE_MODEL_TYPES`).

    Args:
        knock (`str`, defaults to `"mlp_v"`): a preset (`mlp_v`, `linear_v`, `linear_qkv`, `mlp_v_linear_qk`) that
            sets the knock types of queries, keys and values at once, as `KHAConfig(knock=...)` does.
        knock_q, knock_k, knock_v (`str`, *optional*): override one target's type (`none`, `linear`, and `mlp` for
            values): `T^Q`, `T^K`, `T^V` of the paper's KHA-Linear, or its KHA-MLP on values.
        knock_layers (`list[int]`, *optional*): the layers that get knocks; every softmax-attention layer when unset.
        base_model_type (`str`, *optional*): the family the adapter was made for; recorded when it is applied and
            checked when it is loaded onto another model.
        target_modules: derived from the model (its family's projections in the knocked layers); any value given is
            replaced, so an adapter file cannot point the knocks elsewhere.
        modules_to_save (`list[str]`, *optional*): other modules trained in full and saved with the knocks.
        init_weights (`bool`, defaults to `True`): the identity at init; `False` gives a seeded perturbation of it
            (PEFT's convention, so that tests of saving, merging and unloading see an adapter that does something).
        layers_to_transform (`int | list[int]`, *optional*): PEFT's name for `knock_layers`; both, if given, agree.
        layers_pattern (`str`, *optional*): accepted as `"layers"` (the only layer list knock adapters find).

    At init every knock is the identity, so the adapted model computes bit for bit what the stock model computes.
    """

    knock: str = field(default=DEFAULT_KNOCK, metadata={"help": f"knock preset, one of {', '.join(KNOCK_PRESETS)}"})
    knock_q: str | None = field(default=None, metadata={"help": "override the query knock: none, linear or mlp"})
    knock_k: str | None = field(default=None, metadata={"help": "override the key knock: none, linear or mlp"})
    knock_v: str | None = field(default=None, metadata={"help": "override the value knock: none, linear or mlp"})
    knock_layers: list[int] | None = field(default=None, metadata={"help": "layer indices; all when unset"})
    target_modules: Any = field(default=None, metadata={"help": "derived from the model; any value is replaced"})
    modules_to_save: list[str] | None = field(default=None, metadata={"help": "other modules to train and save"})
    base_model_type: str | None = field(default=None, metadata={"help": "the base family; recorded when applied"})
    init_weights: bool = field(
        default=True,
        metadata={
            "help": "True: every knock starts as the identity (the adapted model computes the stock model's outputs). "
            "False: a seeded perturbation of the identity, PEFT's convention for testing save/load, merging and "
            "unloading on an adapter that is not a no-op, and for research"
        },
    )
    layers_to_transform: int | list[int] | None = field(
        default=None, metadata={"help": "PEFT's name for knock_layers (one index or a list); both must agree"}
    )
    layers_pattern: str | list[str] | None = field(
        default=None, metadata={"help": "PEFT's name of the layer list; knock adapters find `...layers.<i>` only"}
    )

    def __post_init__(self) -> None:
        # target_modules is derived from the model (peft/model.py): one pattern of the knocked projections that
        # already names the layers, never PEFT's own layer selection. PEFT 0.22 refuses a str target_modules beside
        # layers_to_transform (PEFT itself would ignore the layers), so it is set aside during PEFT's checks.
        derived, self.target_modules = self.target_modules, None
        super().__post_init__()
        self.target_modules = derived
        self.peft_type = knock_peft_type()
        if self.task_type is None:
            self.task_type = "CAUSAL_LM"
        if not isinstance(self.knock, str) or self.knock not in KNOCK_PRESETS:
            raise ValueError(
                f"KnockConfig: unknown knock preset {self.knock!r}; choose one of {', '.join(KNOCK_PRESETS)}"
            )
        for target, allowed in KNOCK_TYPES.items():
            value = getattr(self, f"knock_{target}")
            allowed = tuple(kind for kind in allowed if kind not in CONTROL_TYPES)
            if value is not None and value not in allowed:
                raise ValueError(
                    f"KnockConfig: knock_{target}={value!r} is not valid; choose one of {', '.join(allowed)}"
                )
        controls = [kind for kind in self.knock_types.values() if kind in CONTROL_TYPES]
        if controls:  # the gate_v preset: a control of the paper's from-scratch ablation, not an adapter
            raise ValueError(
                "KnockConfig: " + control_refusal(f"knock={self.knock!r} is the gate-only control", "a knock adapter")
            )
        if not isinstance(self.init_weights, bool):
            raise ValueError(f"KnockConfig: init_weights must be True or False, got {self.init_weights!r}")
        if self.layers_pattern not in (None, "layers", ["layers"]):
            raise ValueError(
                f"KnockConfig: layers_pattern {self.layers_pattern!r} is not supported: knock adapters find the "
                "decoder layers as `...layers.<i>` (leave it unset or 'layers')"
            )
        if self.layers_to_transform is not None:
            alias = self.layers_to_transform
            alias = [alias] if isinstance(alias, int) and not isinstance(alias, bool) else alias
            if not isinstance(alias, (list, tuple)):
                raise ValueError("KnockConfig: layers_to_transform must be a layer index or a list of them")
            if self.knock_layers is not None and sorted(set(self.knock_layers)) != sorted(set(alias)):
                raise ValueError(
                    f"KnockConfig: knock_layers {self.knock_layers} and layers_to_transform {alias} disagree "
                    "(they name the same thing: give one)"
                )
            self.knock_layers = list(alias)
        if self.knock_layers is not None:
            layers = self.knock_layers
            if (
                not isinstance(layers, (list, tuple))
                or len(layers) > MAX_KNOCK_LAYERS
                or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < MAX_KNOCK_LAYERS for i in layers)
            ):
                raise ValueError("KnockConfig: knock_layers must be a list of layer indices (non-negative integers)")
            self.knock_layers = sorted(set(layers))
            if self.layers_to_transform is not None:
                self.layers_to_transform = list(self.knock_layers)
        if self.modules_to_save is not None and (
            not isinstance(self.modules_to_save, (list, tuple))
            or not all(isinstance(m, str) for m in self.modules_to_save)
        ):
            raise ValueError("KnockConfig: modules_to_save must be a list of module names")
        if self.base_model_type is not None and not isinstance(self.base_model_type, str):
            raise ValueError("KnockConfig: base_model_type must be a model type name")
        if not self.knock_types:
            raise ValueError("KnockConfig: every knock type is 'none': the adapter would do nothing")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str, subfolder: str | None = None, **kwargs):
        """As peft's, and a local folder read is kept as `loaded_from` (not saved: not a field), so that the tuner
        can check the folder's weights file against the model before peft reads it (`check_file_saves_its_modules`)."""
        config = super().from_pretrained(pretrained_model_name_or_path, subfolder=subfolder, **kwargs)
        folder = Path(str(pretrained_model_name_or_path)).expanduser()
        folder = folder / subfolder if subfolder else folder
        if folder.is_dir():
            config.loaded_from = folder
        return config

    @property
    def knock_types(self) -> dict[str, str]:
        """target (q / k / v) -> knock type, for the targets that get a knock (the preset with the overrides)."""
        preset = zip(("q", "k", "v"), KNOCK_PRESETS[self.knock], strict=True)
        types = {target: getattr(self, f"knock_{target}") or kind for target, kind in preset}
        return {target: kind for target, kind in types.items() if kind != "none"}
