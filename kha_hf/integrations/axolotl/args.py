"""The plugin's YAML keys: a `knock:` block, checked by Axolotl's own config validation before any model loads.

Axolotl merges `KHAArgs` into its config model (`get_input_args`), so a bad value fails `axolotl train` (and
`validate_config`) with pydantic's message, which names the key (`knock.preset`) and the values allowed.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from ...modeling.configuration_kha import DEFAULT_KNOCK, KNOCK_PRESETS
from ...modeling.families import FAMILIES, attention_layers

KNOCK_ADAPTER = "knock"  # the `adapter:` value the plugin adds
Preset = Literal[tuple(KNOCK_PRESETS)]  # type: ignore[valid-type]


class KnockArgs(BaseModel):
    """`knock:`: the knock adapter's `KnockConfig` (or, on a KHA base, which knocks train); every field optional."""

    model_config = ConfigDict(extra="forbid")  # a misspelt key (`presets:`) fails, naming it

    preset: Preset = Field(default=DEFAULT_KNOCK, description=f"a KnockConfig preset: {', '.join(KNOCK_PRESETS)}")
    knock_q: Literal["none", "linear"] | None = Field(default=None, description="override the query knock")
    knock_k: Literal["none", "linear"] | None = Field(default=None, description="override the key knock")
    knock_v: Literal["none", "linear", "mlp"] | None = Field(default=None, description="override the value knock")
    # strict: "7" or 7.0 would be coerced after the layer check below had skipped them; [] would knock nothing
    layers: list[StrictInt] | None = Field(
        default=None, min_length=1, description="layer indices (all softmax-attention layers if unset)"
    )
    init_weights: StrictBool = Field(default=True, description="identity at init (False: a seeded perturbation of it)")
    modules_to_save: list[str] | None = Field(default=None, description="other modules to train in full and save")

    def knock_config_kwargs(self) -> dict[str, Any]:
        """The `KnockConfig` keywords this block sets."""
        return {
            "knock": self.preset,
            "knock_q": self.knock_q,
            "knock_k": self.knock_k,
            "knock_v": self.knock_v,
            "knock_layers": self.layers,
            "init_weights": self.init_weights,
            "modules_to_save": self.modules_to_save,
        }


def base_model_config(data: dict[str, Any]) -> Any | None:
    """The base model's config (what `base_model_config` or `base_model` names), or None when it cannot be read
    here (a Hub id offline): then the same checks run, in one line, when the adapter is built."""
    name = data.get("base_model_config") or data.get("base_model")
    if not name:
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(name), trust_remote_code=bool(data.get("trust_remote_code")))
    except (OSError, ValueError):
        return None  # Axolotl's own loading reports it


class KHAArgs(BaseModel):
    """The keys kha-hf's plugin adds to an Axolotl config."""

    knock: KnockArgs | None = Field(
        default=None, description="adapter: knock: the knock adapter (KnockConfig) to train; see docs/guides/axolotl.md"
    )

    @model_validator(mode="before")
    @classmethod
    def check_knock_fits_the_model(cls, data: Any) -> Any:
        """`adapter: knock` on a family KHA supports, with layers the model has: checked on the base model's config
        (no weights loaded), so a mistake fails before anything loads."""
        if not isinstance(data, dict):
            return data
        if data.get("adapter") != KNOCK_ADAPTER:
            if data.get("knock") is not None:
                raise ValueError(
                    f"the knock: block configures adapter: knock, and adapter is {data.get('adapter')!r}: set "
                    "adapter: knock, or remove the block (a KHA base's own knocks train with unfrozen_parameters)"
                )
            return data
        config = base_model_config(data)
        if config is None:
            return data
        model_type = getattr(config, "model_type", None)
        if model_type == "kha":
            raise ValueError(
                "adapter: knock needs a stock base model; base_model is a KHA checkpoint, which has knocks already: "
                "train them with no adapter (unfrozen_parameters) or put adapter: lora on it"
            )
        if model_type not in FAMILIES:
            raise ValueError(
                f"adapter: knock does not support model_type {model_type!r}; supported: {', '.join(FAMILIES)}"
            )
        block = data.get("knock") or {}
        layers = block.get("layers") if isinstance(block, dict) else None
        if isinstance(layers, list) and all(isinstance(i, int) for i in layers) and _has_layers(config):
            allowed = attention_layers(config)
            bad = [i for i in layers if i not in allowed]
            if bad:
                raise ValueError(
                    f"knock.layers {bad[:5]} are not attention layers of this {model_type} model; allowed: "
                    f"{_ranges(allowed)}"
                )
        return data


def _has_layers(config: Any) -> bool:
    return isinstance(getattr(config, "num_hidden_layers", None), int)


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)
