"""A checkpoint's config.json against its weights, read from safetensors headers before any model is built.

transformers builds the model its config describes and then fills it from the weight files: a config that claims
three layers over two-layer weights gets a randomly initialised third layer (a warning in a long log), one that
claims 10^9 layers allocates until the machine runs out of memory, and head counts of 0 or a dtype named
"float128" end in tracebacks. The tools check first and answer in one line.

These rules read no file (the tied-output rule aside, which compares the stored head with the embeddings): they take
a config (dict or object) and the tensor headers that `reader.open_checkpoint` read once, and it applies them as it
opens a folder (`check_config`, then `check_weights`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from ..common.errors import KHAError
from ..modeling.configuration_kha import TASK_HEADS, KHAConfig, base_config_class, multimodal_text_type
from ..modeling.families import FAMILIES, family_spec, projection_features
from .knock_tensors import KNOCK_KEY, knock_specs
from .safetensors_index import TensorInfo

# Architecture sizes that must be positive integers wherever a config has them.
SIZE_FIELDS = (
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "vocab_size",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "max_position_embeddings",
)
MAX_LAYERS = 4096  # the deepest open decoders have about 128
LAYER_COUNT_FIELDS = ("num_hidden_layers", "depth", "num_layers")  # depth: Qwen-VL's vision towers
_LAYER = re.compile(r"^(?:.*\.)?layers\.(\d+)\.")
_PROJECTION = re.compile(r"^(?:.*\.)?layers\.\d+\.self_attn\.(\w+)\.weight$")
_PROJECTION_KEY = re.compile(r"^(?P<prefix>.*)layers\.\d+\.self_attn\.(?P<projection>\w+)\.weight$")


def check_config_numbers(config: dict, where: str) -> None:
    """Sizes are positive integers; the dtype names a torch floating dtype (or 'auto'); no value is NaN or
    infinite; the activation, RoPE and layer types are ones the model code knows (`check_config_values`)."""
    _check_sizes(config, where)
    check_config_values(config, where)
    if isinstance(config.get("text_config"), dict):  # a multimodal model's text decoder: the same checks
        check_config_numbers(config["text_config"], f"{where} (text_config)")
    if isinstance(config.get("vision_config"), dict):  # its vision tower: sizes (its RoPE is its own: axial, ...)
        _check_sizes(config["vision_config"], f"{where} (vision_config)")
    for name in ("dtype", "torch_dtype"):
        value = config.get(name)
        if isinstance(value, str) and value != "auto":
            dtype = getattr(torch, value.removeprefix("torch."), None)
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise KHAError(f"{where}: {name} {value!r} is not a torch floating-point dtype")


def _check_sizes(config: dict, where: str) -> None:
    for name in SIZE_FIELDS:
        value = config.get(name)
        if name in config and value is not None and (type(value) is not int or value <= 0):
            raise KHAError(f"{where}: {name} must be a positive integer, got {value!r}")
    for name in LAYER_COUNT_FIELDS:  # transformers would build them all before reading a weight
        layers = config.get(name)
        if type(layers) is int and layers > MAX_LAYERS:
            raise KHAError(f"{where}: {name} {layers} is beyond any model's ({MAX_LAYERS} at most)")


_SOFTMAX_LAYER_TYPES = {"full_attention", "sliding_attention"}
_ROPE_NUMBERS = ("rope_theta", "factor", "partial_rotary_factor")


def check_config_values(config: dict, where: str) -> None:
    """Values that transformers only reads while building the model, where a bad one is a traceback (KeyError
    'evil', a str ** Tensor TypeError) or a silent NaN: checked here, before anything is built."""
    for name in ("model_type", "base_model_type"):  # a list or dict would be a TypeError wherever it is looked up
        value = config.get(name)
        if value is not None and not isinstance(value, str):
            raise KHAError(f"{where}: {name} must be a string, got a {type(value).__name__}")
    bad = _non_finite(config)
    if bad is not None:
        raise KHAError(f"{where}: {bad} is not a finite number")
    from transformers.activations import ACT2FN

    for name in ("hidden_act", "hidden_activation"):
        value = config.get(name)
        if value is not None and (not isinstance(value, str) or value not in ACT2FN):
            raise KHAError(f"{where}: {name} {value!r} is not an activation transformers knows (e.g. silu, gelu)")
    for name, value in config.items():  # a dropout probability past [0, 1] is a traceback deep in the forward
        if name.endswith("dropout") and is_number(value) and not 0 <= value <= 1:
            raise KHAError(f"{where}: {name} {value!r} is not a probability between 0 and 1")
    _check_rope(config, where)
    _check_layer_types(config, where)


def _non_finite(value, path: str = "", depth: int = 0) -> str | None:
    """The key path of the first NaN or infinite number in VALUE (a parsed JSON value), else None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path or "a value"
    if depth > 64:  # config.json files nest a few levels; a deeper one is refused where it is read
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _non_finite(item, f"{path}.{key}" if path else str(key), depth + 1)
        if found is not None:
            return found
    return None


def _check_rope(config: dict, where: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    known = {"default", *ROPE_INIT_FUNCTIONS}
    for field in ("rope_parameters", "rope_scaling"):
        value = config.get(field)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise KHAError(f"{where}: {field} must be a JSON object, got {type(value).__name__}")
        nested = value and all(isinstance(v, dict) or v is None for v in value.values())
        for key, parameters in value.items() if nested else [(None, value)]:
            name = f"{field}.{key}" if key else field
            if parameters is None:
                continue
            rope_type = parameters.get("rope_type", parameters.get("type", "default"))
            if not isinstance(rope_type, str) or rope_type not in known:
                raise KHAError(f"{where}: {name} rope_type {rope_type!r} is not one of: {', '.join(sorted(known))}")
            _check_rope_numbers(parameters, name, where)
    _check_rope_numbers(config, "", where)


def _check_rope_numbers(parameters: dict, name: str, where: str) -> None:
    for number in _ROPE_NUMBERS:
        value = parameters.get(number)
        if value is not None and (type(value) not in (int, float) or not value > 0):
            shown = f"{name}.{number}" if name else number
            raise KHAError(f"{where}: {shown} must be a positive number, got {value!r}")


def _check_layer_types(config: dict, where: str) -> None:
    """layer_types name only attention kinds the family's model builds (linear attention only where it exists)."""
    layer_types = config.get("layer_types")
    if layer_types is None:
        return
    if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
        raise KHAError(f"{where}: layer_types must be a list of strings")
    model_type = config.get("base_model_type") if config.get("model_type") == "kha" else config.get("model_type")
    if model_type not in FAMILIES:
        return  # another architecture: transformers checks its own
    allowed = _SOFTMAX_LAYER_TYPES | _family_layer_types(model_type)
    unknown = sorted(set(layer_types) - allowed)
    if unknown:
        raise KHAError(
            f"{where}: layer_types holds {unknown[0]!r}, which a {model_type} model does not have "
            f"(allowed: {', '.join(sorted(allowed))})"
        )
    layers = config.get("num_hidden_layers")
    if isinstance(layers, int) and len(layer_types) != layers:
        raise KHAError(f"{where}: layer_types lists {len(layer_types)} layers, num_hidden_layers is {layers}")


def _family_layer_types(model_type: str) -> set[str]:
    """The layer kinds a family's default config uses (qwen3_next: linear_attention too)."""
    try:
        return set(getattr(base_config_class(model_type)(), "layer_types", None) or [])
    except Exception:  # a config class that needs arguments: only the softmax kinds
        return set()


def check_weights_match_config(config: dict, tensors: dict[str, TensorInfo], where: str) -> None:
    """The decoder layers the config names exist in the weights, and the embedding matches the vocabulary."""
    layers = config.get("num_hidden_layers")
    found = {int(m.group(1)) for name in tensors if (m := _LAYER.match(name)) and "vision" not in name}
    if isinstance(layers, int) and found:
        within = sum(1 for i in found if i < layers)  # never builds range(layers): it may be absurdly large
        missing, extra = layers - within, len(found) - within
        allowed_extra = config.get("num_nextn_predict_layers") or 0  # DeepSeek-V3's multi-token-prediction layers
        if missing or extra > allowed_extra:
            raise KHAError(
                f"{where}: config.json says {layers} layers, the weights hold {len(found)} "
                f"(layer indices {min(found)}..{max(found)})"
            )
    vocab = config.get("vocab_size")
    embedding = next((info for name, info in tensors.items() if name.endswith("embed_tokens.weight")), None)
    if embedding is not None and not embedding.dtype.is_floating_point:
        raise KHAError(f"{where}: the token embedding is stored as {embedding.dtype}, not a floating-point tensor")
    if isinstance(vocab, int) and embedding is not None and embedding.shape[0] != vocab:
        raise KHAError(f"{where}: config.json says vocab_size {vocab}, the embedding has {embedding.shape[0]} rows")
    hidden = config.get("hidden_size")
    if isinstance(hidden, int) and embedding is not None and len(embedding.shape) == 2:
        if embedding.shape[1] != hidden:
            width = embedding.shape[1]
            raise KHAError(f"{where}: config.json says hidden_size {hidden}, the embedding is {width} wide")


def check_attention_layout(config, tensors: dict[str, TensorInfo], where: str) -> None:
    """Every attention projection in the weights has the output size the family's KHA layout gives it (CONFIG: a
    KHA or base config object): the knocks split those outputs into heads, so a mismatch must stop here."""
    model_type = config.base_model_type if config.model_type == "kha" else config.model_type
    layout = family_spec(model_type).layout
    for name, info in tensors.items():
        match = _PROJECTION.match(name)
        if match and match.group(1) in layout:
            expected = projection_features(config, layout[match.group(1)])
            if info.shape[:1] != (expected,):
                raise KHAError(
                    f"{where}: {name} has shape {list(info.shape)}; the config's head counts and sizes give "
                    f"{expected} output features"
                )


def model_tensor_shapes(base, where: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor the causal LM that BASE (a base config object) describes holds, the tied output
    aside; the model is built on the meta device (no memory, no weights). One-line KHAError where the family's code
    cannot build it."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        try:
            skeleton = AutoModelForCausalLM.from_config(base)
        except Exception as err:  # the family's code rejects what it cannot build, in its own words
            raise KHAError(f"{where}: {str(err)[:300]}") from None
    expected = {name: tuple(p.shape) for name, p in skeleton.state_dict().items()}
    if getattr(base, "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)
    return expected


TIED_ROWS = 4096  # rows compared at once: memory stays flat on any vocabulary


def check_tied_output(config, tensors: dict[str, TensorInfo], folder, where: str) -> None:
    """One-line KHAError when CONFIG ties the output to the embeddings (`tie_word_embeddings`) yet the weights hold an
    `lm_head.weight` that differs from them: transformers unties and uses the stored head, vLLM and llama.cpp tie, so
    one checkpoint would give other logits per engine. A stored head equal to the embeddings, bit for bit, is
    accepted (compared TIED_ROWS rows at a time, from FOLDER's files)."""
    from safetensors import safe_open

    head = tensors.get("lm_head.weight")
    if head is None or not getattr(config, "tie_word_embeddings", False):
        return
    embedding = next((name for name in tensors if name.endswith(".embed_tokens.weight")), None)
    if embedding is None:  # a layout without `embed_tokens` (every family KHA supports has one): nothing to compare
        return
    differs = tensors[embedding].shape != head.shape or tensors[embedding].dtype != head.dtype
    if not differs:
        with (
            safe_open(str(folder / head.file), framework="pt") as h,
            safe_open(str(folder / tensors[embedding].file), framework="pt") as e,
        ):
            rows_h, rows_e = h.get_slice("lm_head.weight"), e.get_slice(embedding)
            for start in range(0, head.shape[0], TIED_ROWS):
                if not torch.equal(rows_h[start : start + TIED_ROWS], rows_e[start : start + TIED_ROWS]):
                    differs = True
                    break
    if differs:
        raise KHAError(
            f"{where} says tie_word_embeddings, yet the weights hold an lm_head.weight that differs from the "
            "embeddings (transformers would use it, vLLM and llama.cpp the embeddings): set tie_word_embeddings to "
            "false"
        )


def check_tensor_shapes(expected: dict[str, tuple[int, ...]], tensors: dict[str, TensorInfo], where: str) -> None:
    """Every tensor of TENSORS that the model has (EXPECTED, `model_tensor_shapes`) has its shape (input features,
    the embedding's and the output's rows, ...) and a floating-point dtype: transformers would stop on a size
    mismatch with a traceback, and an integer weight computes nothing a model means."""
    for name, info in tensors.items():
        shape = expected.get(name)
        if shape is None:
            continue
        if tuple(info.shape) != shape:
            raise KHAError(f"{where}: {name} has shape {list(info.shape)}; the config gives {list(shape)}")
        if not info.dtype.is_floating_point:
            raise KHAError(f"{where}: {name} is stored as {info.dtype}, not a floating-point tensor")


def _module_path(name: str) -> str:
    """NAME without the `model.` / `language_model.` components, where multimodal checkpoints of transformers'
    older and newer layouts differ (`language_model.model.layers.0...` = `model.language_model.layers.0...`)."""
    return ".".join(part for part in name.split(".") if part not in ("model", "language_model"))


def check_multimodal_weights(config, tensors: dict[str, TensorInfo], where: str) -> None:
    """A multimodal checkpoint's weights hold every parameter of the model its CONFIG (a KHA or base config object
    of a wrapper: gemma3, mistral3, ...) builds, vision tower and projector included: a config that names another
    wrapper than the weights were saved from (a Gemma 3 checkpoint relabelled mistral3) stops here, in one line.
    The model is built on the meta device: no memory, no weights."""
    from transformers import AutoModelForImageTextToText

    base = config.to_base_config() if config.model_type == "kha" else config
    try:
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(base)
    except Exception as err:  # the family's code rejects the config, in its own words
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise KHAError(f"{where}: cannot build the {base.model_type} model it describes: {reason}") from err
    stored = {_module_path(name): info for name, info in tensors.items()}
    params = dict(model.named_parameters())
    missing = sorted(name for name in params if _module_path(name) not in stored)
    if missing:
        raise KHAError(
            f"{where}: the weights are not those of the {base.model_type} model the config describes: "
            f"{len(missing)} of its parameters are missing (e.g. {missing[0]})"
        )
    # the vision tower and projector, whose sizes nothing else checks (the text decoder's are: check_layout)
    for name, param in params.items():
        info = stored[_module_path(name)]
        text = "language_model" in name or "text_model" in name
        if not text and tuple(info.shape) != tuple(param.shape):
            raise KHAError(
                f"{where}: {name} is stored with shape {list(info.shape)}; the config gives {list(param.shape)}"
            )


# The tensors of transformers' task heads (GenericForSequenceClassification / ...ForTokenClassification: `score`,
# ...ForQuestionAnswering: `qa_outputs`), all at the top level of a checkpoint.
HEAD_TENSORS = ("score.weight", "qa_outputs.weight")
HEAD_SUFFIXES = tuple(name.removeprefix("KHA") for name in TASK_HEADS)  # ForSequenceClassification, ...


def architectures_of(config: dict, where: str) -> list[str]:
    """CONFIG's `architectures`: a list of class names ([] when unset); one-line KHAError for anything else (a bare
    string would otherwise be read letter by letter)."""
    value = config.get("architectures")
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise KHAError(f"{where}: architectures must be a list of class names, got {str(value)[:80]!r}")
    return value


def kha_head_name(architecture: str) -> str:
    """`Qwen3ForSequenceClassification` or `KHAForSequenceClassification` -> `KHAForSequenceClassification`."""
    return next("KHA" + suffix for suffix in HEAD_SUFFIXES if architecture.endswith(suffix))


def num_labels(config: dict) -> int:
    """The label count a head config gives (`id2label` when present, as transformers reads it; default 2)."""
    labels = config.get("id2label")
    if isinstance(labels, dict) and labels:
        return len(labels)
    count = config.get("num_labels", 2)
    return count if isinstance(count, int) else 2


def check_head_weights(config: dict, kha_class: str, tensors: dict[str, TensorInfo], where: str) -> None:
    """The weights hold the head KHA_CLASS needs, in the shape CONFIG gives, and a causal LM holds no head: a head
    missing from the weights would load newly initialised (a random reward model), without a word."""
    if kha_class not in TASK_HEADS:
        head = next((name for name in HEAD_TENSORS if name in tensors), None)
        if head is not None and "lm_head.weight" not in tensors:
            raise KHAError(
                f"{where}: the weights hold a task head ({head}) and no lm_head, but architectures names a causal "
                "LM: name the head class in architectures (e.g. Qwen3ForSequenceClassification)"
            )
        return
    hidden = config.get("hidden_size")
    if kha_class == "KHAForQuestionAnswering":
        needed = {"qa_outputs.weight": (2, hidden), "qa_outputs.bias": (2,)}
    else:
        labels = num_labels(config)
        needed = {"score.weight": (labels, hidden)}
        if kha_class == "KHAForTokenClassification" and config.get("token_classification_bias", True):
            needed["score.bias"] = (labels,)
    for name, shape in needed.items():
        info = tensors.get(name)
        if info is None:
            raise KHAError(f"{where} names a {kha_class.removeprefix('KHAFor')} head, but the weights lack {name}")
        if tuple(info.shape) != shape:
            raise KHAError(
                f"{where}: {name} has shape {list(info.shape)}; the config gives {list(shape)} "
                "(num_labels / id2label and hidden_size)"
            )
        if not info.dtype.is_floating_point:
            raise KHAError(f"{where}: {name} is stored as {info.dtype}, not a floating-point tensor")


def check_knocks_fit(
    expected: Mapping[str, tuple[int, ...]],
    given: Mapping[str, torch.Tensor],
    misfit: Callable[[list[str], list[str]], Exception],
    misshaped: Callable[[str, tuple[int, ...], tuple[int, ...]], Exception],
) -> None:
    """The one check that an adapter's knocks are the knocks a model needs (`kha convert --adapter`, and PEFT loading
    a knock adapter): GIVEN (knock tensors by name) holds every name of EXPECTED (name -> shape) and no other, each
    of the expected shape. The caller words the refusal: the exception MISFIT(missing, extra) or
    MISSHAPED(name, its shape, the expected shape) returns is raised (names sorted, the first misshapen tensor in
    GIVEN's order)."""
    missing, extra = sorted(set(expected) - set(given)), sorted(set(given) - set(expected))
    if missing or extra:
        raise misfit(missing, extra)
    for name, tensor in given.items():
        if tuple(tensor.shape) != tuple(expected[name]):
            raise misshaped(name, tuple(tensor.shape), tuple(expected[name]))


def knock_keys(tensors: dict[str, TensorInfo]) -> list[str]:
    return sorted(name for name in tensors if KNOCK_KEY.match(name))


def check_knock_tensors(config: KHAConfig, tensors: dict[str, TensorInfo], prefix: str, folder: Path) -> None:
    """The checkpoint holds exactly the knock tensors its config describes, each a d_h x d_h matrix."""
    expected = knock_specs(config, prefix)
    found = set(knock_keys(tensors))
    missing = sorted(set(expected) - found)
    if missing:
        raise KHAError(f"{folder}: knock tensor {missing[0]} is missing ({len(missing)} missing in all)")
    extra = sorted(found - set(expected))
    if extra:
        raise KHAError(
            f"{folder}: knock tensor {extra[0]} is not described by config.json (knocks {config.knock_q}/"
            f"{config.knock_k}/{config.knock_v} on layers {_layers(config)}); {len(extra)} such tensors"
        )
    for name in sorted(found):
        d = expected[name][1]
        if not tensors[name].dtype.is_floating_point:
            raise KHAError(f"{folder}: knock tensor {name} is {tensors[name].dtype}, not a floating-point tensor")
        if tensors[name].shape != (d, d):
            raise KHAError(f"{folder}: knock tensor {name} has shape {list(tensors[name].shape)}, expected [{d}, {d}]")


def _layers(config: KHAConfig) -> str:
    layers = config.knocked_layers
    return f"0..{layers[-1]}" if layers == list(range(len(layers))) else ",".join(map(str, layers))


def family_type(config: dict):
    """The family's model_type of CONFIG (a config.json dict): `base_model_type` for a KHA checkpoint."""
    return config.get("base_model_type") if config.get("model_type") == "kha" else config.get("model_type")


def task_head(config: dict, tensors: dict[str, TensorInfo], where: str) -> str | None:
    """`Checkpoint.task_head` of CONFIG and TENSORS."""
    named = next((n for n in architectures_of(config, where) if n.endswith(HEAD_SUFFIXES)), None)
    if named is not None:
        return named
    found = next((name for name in HEAD_TENSORS if name in tensors), None)
    if found is not None and "lm_head.weight" not in tensors:
        return f"task-head checkpoint (its weights hold {found} and no lm_head)"
    return None


def check_config(config: dict, folder: Path, trust_remote_code: bool | None) -> None:
    """CONFIG (FOLDER's config.json) alone: `check_config_numbers`, then `check_remote_code_allowed` where the tool
    loads the model (TRUST_REMOTE_CODE not None)."""
    check_config_numbers(config, str(folder / "config.json"))
    if trust_remote_code is not None:
        check_remote_code_allowed(config, folder, trust_remote_code)


def check_remote_code_allowed(config: dict, folder: Path, trust_remote_code: bool) -> None:
    """A folder whose architecture only its own code files know (auto_map, a model_type transformers lacks) needs
    --trust-remote-code; say so in one line instead of letting transformers prompt or fail."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = config.get("model_type")
    if trust_remote_code or model_type == "kha" or model_type in CONFIG_MAPPING or not config.get("auto_map"):
        return
    raise KHAError(
        f"{folder} ships its own model code (auto_map, model_type {model_type!r}); it was not run. "
        "Pass --trust-remote-code if you trust that code"
    )


def layer_prefix(tensor_names, config: KHAConfig) -> str:
    """The prefix in front of the text decoder's `layers.` in a checkpoint of CONFIG's model: `model.` for
    ...ForCausalLM checkpoints, `model.language_model.` (Gemma 3, Qwen2.5-VL), `model.text_model.` (SmolVLM),
    `language_model.model.` (Llama 4, and Hub checkpoints of the older multimodal layout)."""
    model_type = config.knock_config.base_model_type
    projections = set(family_spec(model_type).layout)
    prefixes: list[str] = []
    for name in tensor_names:
        match = _PROJECTION_KEY.match(name)
        if match and match.group("projection") in projections and match.group("prefix") not in prefixes:
            prefixes.append(match.group("prefix"))
    if not prefixes:
        raise ValueError(
            f"no `layers.N.self_attn.{{{', '.join(sorted(projections))}}}.weight` tensor: the weights do not follow "
            f"the {model_type} attention layout"
        )
    if not config.is_multimodal:
        return prefixes[0]
    # A vision tower may name its attention as the text decoder does (SigLIP, Pixtral). The text decoder's prefix
    # is made of these names only (model.language_model., language_model.model., model.text_model., Qwen2.5-VL's
    # model.); a tower's names the tower (vision_tower., visual., ...). It is required even when it is the only
    # prefix found: a checkpoint whose text layers are missing must not get its knocks in the vision tower.
    text = [p for p in prefixes if set(p.rstrip(".").split(".")) <= {"model", "language_model", "text_model"}]
    if len(text) != 1:
        found = ", ".join(prefixes)
        raise ValueError(f"cannot tell which of these layer stacks is the text decoder's: {found}")
    return text[0]


def check_weights(folder: Path, config: dict, tensors: dict[str, TensorInfo], built, causal_lm: bool | str) -> tuple:
    """`checks.py`'s rules on CONFIG and TENSORS: (the config object built, the model's tensor shapes, the text
    decoder's layer prefix, the stock config of the causal LM) of a family kha knows; (BUILT, None, ...) for another
    architecture, whose code (transformers' or its own) checks its own. A KHA config (BUILT by the tool, or a KHA
    checkpoint's own) also places the knocks: the text decoder's layers are found, and a KHA checkpoint holds exactly
    the knock tensors its config describes. CAUSAL_LM: a task head is refused first (a string: why, in the tool's
    words)."""
    where = str(folder / "config.json")
    if causal_lm:  # a string: the tool's own words for it
        why = causal_lm if isinstance(causal_lm, str) else NOT_A_LANGUAGE_MODEL
        refuse_task_head(folder, task_head(config, tensors, where), why)
    if not tensors:  # a config without weights (a tool that needs them refuses: `Checkpoint.weights`)
        return built, None, None, None
    kha, model_type = config.get("model_type") == "kha", family_type(config)
    multimodal = multimodal_text_type(model_type) is not None
    if built is None and (model_type in FAMILIES or multimodal):
        fields = {k: v for k, v in config.items() if k != "model_type"}
        try:
            built = KHAConfig(**fields) if kha else base_config_class(model_type)(**fields)
        except Exception as err:  # the family's config class rejects what it cannot use, in its own words
            raise KHAError(f"{where}: {str(err).strip().splitlines()[0]}") from err
    prefix = None
    if isinstance(built, KHAConfig):
        try:
            prefix = layer_prefix(tensors, built)
        except ValueError as err:
            raise KHAError(f"{folder}: {err}") from err
    # a KHA checkpoint's layer count is its model's; its knocks are then those its config describes
    check_weights_match_config(config, {n: i for n, i in tensors.items() if not (kha and KNOCK_KEY.match(n))}, where)
    if kha and prefix is not None:
        check_knock_tensors(built, tensors, prefix, folder)
    head = next((name for name in architectures_of(config, where) if name.endswith(HEAD_SUFFIXES)), None)
    check_head_weights(config, kha_head_name(head) if head else "KHAForCausalLM", tensors, where)
    if model_type not in FAMILIES and not multimodal:
        return built, None, prefix, None
    if multimodal:
        if prefix is not None:  # the text decoder against its text_config: the knocks split its projections
            text, text_where = built.knock_config, f"{where} (text_config)"
            text_tensors = {name: info for name, info in tensors.items() if name.startswith(prefix)}
            check_weights_match_config(text.to_dict(), text_tensors, text_where)
            check_attention_layout(text, text_tensors, text_where)
        check_multimodal_weights(built, tensors, where)
        return built, None, prefix, None
    check_attention_layout(built, tensors, where)
    base = built.to_base_config() if built.model_type == "kha" else built
    shapes = model_tensor_shapes(base, where)
    check_tensor_shapes(shapes, tensors, where)
    # every tensor the model has is stored: transformers would fill a missing one at random (a task head's body
    # has no lm_head: its head was checked above). Only where the files name the model's own tensors: transformers
    # renames and fuses some on load (5.x: a MoE's per-expert weights into `experts.gate_up_proj`)
    names = {name for name in tensors if not KNOCK_KEY.match(name)}
    missing = sorted(set(shapes) - names - ({"lm_head.weight"} if head else set()))
    if missing and names <= set(shapes) | {"lm_head.weight"}:
        raise KHAError(f"{where} does not describe the weights: {len(missing)} tensors missing {missing[:2]}")
    check_tied_output(base, tensors, folder, where)
    return built, shapes, prefix, base


NOT_A_LANGUAGE_MODEL = (
    "not a language model: this command needs a causal LM; load it with its own Auto class (e.g. "
    "AutoModelForSequenceClassification)"
)


def refuse_task_head(folder: Path, head: str | None, why: str = NOT_A_LANGUAGE_MODEL) -> None:
    """A reward model or classifier loaded as a causal LM would get a new, random LM head: refused in one line,
    `FOLDER is a HEAD, WHY`."""
    if head is not None:
        raise KHAError(f"{folder} is a {head}, {why}")


def is_number(value) -> bool:
    """A JSON number (an int or float, not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
