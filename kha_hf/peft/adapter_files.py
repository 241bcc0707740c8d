"""Knock adapter folders and KHA checkpoints, one into the other, from the command line.

`read_knock_adapter`: an adapter folder read without loading a model, its config and its knocks under a KHA model's
names. `write_knock_adapter`: a KHA checkpoint's knocks saved as a knock adapter of its stock base (`kha adapter`).

`kha convert BASE DST --adapter ADAPTER_DIR` (`convert(..., trained_knocks=read_knock_adapter(dir))`) streams
BASE into a KHA checkpoint whose knocks are the adapter's (instead of identities): the servable form of an adapter
whose MLP knocks cannot merge into a stock model. Only what a knock adapter holds is accepted: `adapter_config.json`
of type KNOCK, validated by `KnockConfig`, and `adapter_model.safetensors` (never a pickle) holding knock tensors
only, every one finite floating point. Which knocks and shapes the KHA model needs is checked by
`checkpoint.adapter_knocks`.

Adapter keys, as `KnockModel.save_pretrained` writes them (the adapter's name stripped):
`base_model.model.model.layers.3.self_attn.v_proj.knock_sets.v_knock.net.0.weight` -> KHA key
`model.layers.3.self_attn.v_knock.net.0.weight`.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..checkpoint.adapter_knocks import TrainedKnocks, adapter_kha_config, adapter_knocks
from ..checkpoint.paths import check_source_links
from ..checkpoint.safetensors_index import read_header
from ..common.errors import KHAError
from ..common.text_files import read_json_object
from .config import KNOCK_PEFT_TYPE, KnockConfig

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_ADAPTER_KEY = re.compile(r"^(?P<layer>.+)\.[^.]+\.knock_sets\.(?P<knock>[qkv]_knock\.[A-Za-z0-9_.]+)$")
MAX_CONFIG_BYTES = 1 << 20


def read_adapter_config(folder: Path) -> KnockConfig:
    """FOLDER's adapter_config.json as a KnockConfig; one-line KHAError for anything else."""
    path = folder / ADAPTER_CONFIG
    if not path.is_file():
        raise KHAError(f"{folder} is not a PEFT adapter folder: it has no {ADAPTER_CONFIG}")
    raw = read_json_object(path, MAX_CONFIG_BYTES)
    if raw.get("peft_type") != KNOCK_PEFT_TYPE:
        raise KHAError(
            f"{path}: peft_type {raw.get('peft_type')!r} is not a knock adapter ({KNOCK_PEFT_TYPE}); only knock "
            "adapters convert into a KHA checkpoint"
        )
    known = set(KnockConfig.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise KHAError(f"{path}: unknown fields {unknown[:5]}")
    try:
        return KnockConfig(**{key: value for key, value in raw.items() if key != "peft_type"})
    except (TypeError, ValueError) as err:
        raise KHAError(f"{path}: {str(err)[:300]}") from None


def read_adapter_knocks(folder: Path) -> dict[str, torch.Tensor]:
    """FOLDER's knock tensors under KHA names; refuses pickles, other tensors, non-finite values."""
    path = folder / ADAPTER_WEIGHTS
    if not path.is_file():
        pickled = folder / "adapter_model.bin"
        if pickled.exists():
            raise KHAError(f"{pickled} is a pickle (it could run code); save the adapter with safetensors")
        raise KHAError(f"{folder} has no {ADAPTER_WEIGHTS}")
    header = read_header(path)  # validated: dtypes, shapes, byte ranges, duplicate names
    names: dict[str, str] = {}
    for key in header:
        match = _ADAPTER_KEY.match(key[len(PEFT_PREFIX) :]) if key.startswith(PEFT_PREFIX) else None
        if match is None:
            raise KHAError(
                f"{path}: {key} is not a knock tensor: kha reads adapters that hold knocks only (the weights of "
                "modules_to_save would be lost)"
            )
        kha_key = f"{match['layer']}.{match['knock']}"
        if kha_key in names.values():
            raise KHAError(f"{path}: two tensors name the knock {kha_key}")
        names[key] = kha_key
    knocks = {}
    with safe_open(path, framework="pt") as f:
        for key, kha_key in names.items():
            tensor = f.get_tensor(key)
            # float8 refused as PEFT loading refuses it (peft/model.py): the knock's matmul has no float8 kernel
            if tensor.dtype.itemsize < 2 or not tensor.is_floating_point() or not torch.isfinite(tensor).all():
                raise KHAError(f"{path}: {key} is not finite floating point ({tensor.dtype})")
            knocks[kha_key] = tensor
    if not knocks:
        raise KHAError(f"{path} holds no knock tensors")
    return knocks


def read_knock_adapter(folder: str | Path) -> TrainedKnocks:
    """The knock adapter in FOLDER (whose files may not link out of it), for `convert(..., trained_knocks=...)`."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise KHAError(f"--adapter {folder}: not a folder (a knock adapter saved by save_pretrained)")
    check_source_links(folder, [name for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if (folder / name).exists()])
    config = read_adapter_config(folder)
    knocks = read_adapter_knocks(folder)
    return TrainedKnocks(config.knock_types, config.knock_layers, config.base_model_type, knocks, folder.absolute())


def looks_like_a_path(text: str) -> bool:
    """True for what can only be a path, never a Hub id (`./m`, `../m`, `/m`, `~/m`, `m/`, three or more parts)."""
    return text.startswith((".", "/", "~")) or text.endswith("/") or text.count("/") >= 2


def write_knock_adapter(
    kha_dir: str | Path, out: str | Path, base: str | None = None, overwrite: bool = False
) -> tuple[Path, int]:
    """Save KHA_DIR's knocks as a knock adapter folder OUT (written atomically, kha's destination rule) for the
    stock model of its base family; BASE (a Hub id or folder) is recorded as the adapter's base model, so that
    `AutoPeftModelForCausalLM.from_pretrained(OUT)` finds it. Returns (OUT, the adapter's parameter count)."""
    from ..checkpoint.knock_reader import open_kha_checkpoint
    from ..checkpoint.output import atomic_output_dir
    from ..checkpoint.paths import check_destination
    from ..modeling.modeling_kha import KHAForCausalLM
    from .convert import knock_adapter_from_kha

    kha_dir = Path(kha_dir).expanduser()
    if base is not None and not Path(base).expanduser().exists() and looks_like_a_path(str(base)):
        raise KHAError(f"--base {base}: no such folder (give the base model's folder or its Hub id)")
    out = check_destination(out, [kha_dir], overwrite)
    if not kha_dir.is_dir():
        raise KHAError(f"{kha_dir} is not a folder: KHA_DIR must be a KHA checkpoint folder")
    check_source_links(kha_dir)
    # read and checked before a model is built: its values, weights and knocks; a task head's body would not load
    # into the causal LM whose knocks are saved
    kha = open_kha_checkpoint(kha_dir, causal_lm=True)
    if kha.checkpoint.is_multimodal:
        raise KHAError(
            f"{kha_dir} is a multimodal KHA checkpoint: knock adapters are made for stock text decoders only; "
            "serve or fine-tune the KHA checkpoint itself"
        )
    kha.read_knocks()  # NaN or infinite knocks refused
    try:
        model = KHAForCausalLM.from_pretrained(kha_dir)
    except (OSError, ValueError) as err:
        raise KHAError(f"cannot load the KHA model in {kha_dir}: {str(err)[:300]}") from err
    adapter = knock_adapter_from_kha(model)
    # a local base is recorded by its absolute path: a relative one, read from another directory, would make
    # AutoPeftModel load whatever model sits there (a Hub id is kept as typed)
    local = None if base is None else Path(base).expanduser()
    adapter.peft_config["default"].base_model_name_or_path = str(local.resolve()) if local and local.exists() else base
    count = sum(p.numel() for n, p in adapter.named_parameters() if ".knock_sets." in n)
    with atomic_output_dir(out, overwrite=overwrite, marker="adapter") as tmp:
        adapter.save_pretrained(tmp)
    return out, count


def check_adapter_fits(base: str | Path, folder: str | Path) -> TrainedKnocks:
    """The knock adapter in FOLDER, read and checked (`read_knock_adapter`) and, when BASE is a local checkpoint
    folder, checked against BASE's config and weight headers as `kha convert --adapter` checks them (family, layers,
    every knock's name and shape) without loading a model: a tool that runs BASE first fails before, not after.
    A Hub id or GGUF BASE is checked when PEFT loads the adapter (`apply_knock_adapter`)."""
    from ..checkpoint.checks import layer_prefix
    from ..checkpoint.knock_tensors import initial_knock_tensors
    from ..checkpoint.loading import find_gguf
    from ..checkpoint.reader import open_checkpoint

    adapter = read_knock_adapter(folder)
    path = Path(str(base)).expanduser()
    if not path.is_dir() or find_gguf(path) is not None:
        return adapter
    checkpoint = open_checkpoint(path)
    config = checkpoint.config
    if checkpoint.is_kha:
        raise KHAError(f"{base} is a KHA checkpoint (it has knocks already): a knock adapter goes on the stock model")
    try:
        kha_config = adapter_kha_config(config, adapter, path)
        prefix = layer_prefix(checkpoint.weights(), kha_config)
    except KHAError:
        raise
    except Exception as err:  # the family's config class rejects the adapter's layers, in its own words
        raise KHAError(f"the adapter {folder} does not fit {base}: {str(err).strip().splitlines()[0][:300]}") from err
    adapter_knocks(initial_knock_tensors(kha_config, torch.float32, prefix), adapter.tensors, str(base))
    return adapter


def apply_knock_adapter(model, folder: str | Path):
    """MODEL (a stock causal LM in eval mode) with the knock adapter in FOLDER, for evaluation: a `PeftModel`.

    The folder is checked as `read_knock_adapter` checks it (a KNOCK config, safetensors knocks only, finite, no link
    out of it) before PEFT reads it; an adapter of another family or size fails in one line."""
    from peft import PeftModel

    adapter = read_knock_adapter(folder)
    model_type = getattr(model.config, "model_type", None)
    if adapter.base_model_type is not None and adapter.base_model_type != model_type:
        raise KHAError(f"the adapter {folder} was trained on a {adapter.base_model_type} model; this is {model_type!r}")
    try:
        return PeftModel.from_pretrained(model, adapter.folder, is_trainable=False).eval()
    except (RuntimeError, ValueError, KeyError) as err:  # size mismatch, layers the model lacks
        reason = str(err).strip().splitlines()[-1][:300] if str(err).strip() else type(err).__name__
        raise KHAError(f"the adapter {folder} does not fit this model (one of another model?): {reason}") from err
