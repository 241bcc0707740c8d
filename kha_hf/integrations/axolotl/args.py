"""The plugin's YAML keys: a `knock:` block, checked by Axolotl's own config validation before any model loads.

Axolotl merges `KHAArgs` into its config model (`get_input_args`), so a bad value fails `axolotl train` (and
`validate_config`) with pydantic's message, which names the key (`knock.preset`) and the values allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from ...checkpoint.checks import check_config_numbers
from ...checkpoint.reader import CONFIG_FILE, read_config_dict
from ...common.errors import KHAError
from ...modeling.configuration_kha import CONTROL_PRESETS, DEFAULT_KNOCK, KNOCK_PRESETS
from ...modeling.families import FAMILIES, attention_layers

KNOCK_ADAPTER = "knock"  # the `adapter:` value the plugin adds
# the paper's gate-only control (gate_v) is for from-scratch A/B runs, not an adapter
Preset = Literal[tuple(p for p in KNOCK_PRESETS if p not in CONTROL_PRESETS)]  # type: ignore[valid-type]


class KnockArgs(BaseModel):
    """`knock:`: the knock adapter's `KnockConfig` (or, on a KHA base, which knocks train); every field optional."""

    model_config = ConfigDict(extra="forbid")  # a misspelt key (`presets:`) fails, naming it

    preset: Preset = Field(default=DEFAULT_KNOCK, description=f"a KnockConfig preset: {', '.join(Preset.__args__)}")
    knock_q: Literal["none", "linear", "mlp"] | None = Field(default=None, description="override the query knock")
    knock_k: Literal["none", "linear", "mlp"] | None = Field(default=None, description="override the key knock")
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


def _one_line(err: BaseException, where: str) -> str:
    """ERR as the one line a refusal shows: a KHAError's own words (they name the file), else WHERE and ERR's words
    on one line, 300 characters at most (the family's config class rejects what it cannot build, in its own words;
    a strict-dataclass error puts the field on its first line and the value on the next)."""
    if isinstance(err, KHAError):
        return str(err)
    reason = " ".join(line.strip() for line in str(err).splitlines() if line.strip())[:300]
    return f"{where}: {reason or type(err).__name__}"


def _config_name(data: dict[str, Any]) -> str | None:
    name = data.get("base_model_config") or data.get("base_model")
    return str(name) if name else None


def _read_hub_config(name: str) -> dict | None:
    """NAME's config.json through transformers' cached download; None when it cannot be had here (offline, unknown
    id): Axolotl's own loading reports it."""
    from transformers import PretrainedConfig

    try:
        fields, _ = PretrainedConfig.get_config_dict(name)
    except (OSError, ValueError):
        return None
    return fields if isinstance(fields, dict) else None


def base_config_fields(data: dict[str, Any]) -> tuple[dict, str] | None:
    """The base model's config.json (what `base_model_config` or `base_model` names) as a dict, and the path that
    refusals name, with nothing built from it: a local folder through kha's own reader (`read_config_dict`: a config
    nested thousands deep is refused), a Hub id through transformers' cached download. None when it cannot be read
    here (a Hub id offline, a folder without a readable config.json: Axolotl's own loading reports it); a one-line
    ValueError when it is there but is no model config."""
    name = _config_name(data)
    if name is None:
        return None
    folder = Path(name)
    where = str(folder / CONFIG_FILE) if folder.is_dir() else name
    try:
        fields = read_config_dict(folder) if folder.is_dir() else _read_hub_config(name)
    except Exception as err:  # RecursionError, MemoryError...: never a traceback out of a config check
        raise ValueError(_one_line(err, where)) from None
    return None if fields is None else (fields, where)


def checked_config_fields(data: dict[str, Any]) -> tuple[dict, str] | None:
    """`base_config_fields`, with the checks kha's own tools make of every config.json (`check_config_numbers`:
    sizes are positive integers, at most 4096 layers, model_type a string, layer_types one per layer...) made
    before anything sized by it is built; a one-line ValueError naming the field and its value otherwise."""
    read = base_config_fields(data)
    if read is None:
        return None
    fields, where = read
    try:
        check_config_numbers(fields, where)
    except Exception as err:
        raise ValueError(_one_line(err, where)) from None
    return read


def build_config(data: dict[str, Any], where: str) -> Any:
    """The config object transformers' AutoConfig builds of the base model DATA names, once `checked_config_fields`
    passed it; a one-line ValueError, naming WHERE, for any failure (the family's config class rejects what it
    cannot build, in its own words: a strict-dataclass error, a TypeError...)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(_config_name(data), trust_remote_code=bool(data.get("trust_remote_code")))
    except Exception as err:
        raise ValueError(_one_line(err, where)) from None


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
        read = checked_config_fields(data)  # before anything sized by the config is built: 10^9 layers
        if read is None:
            return data
        model_type = read[0].get("model_type")  # a string: check_config_numbers refuses anything else
        if model_type == "kha":
            raise ValueError(
                "adapter: knock needs a stock base model; base_model is a KHA checkpoint, which has knocks already: "
                "train them with no adapter (unfrozen_parameters) or put adapter: lora on it"
            )
        if model_type not in FAMILIES:
            raise ValueError(
                f"adapter: knock does not support model_type {model_type!r}; supported: {', '.join(FAMILIES)}"
            )
        config = build_config(data, read[1])
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
