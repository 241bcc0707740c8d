"""Load any model the tools accept: a folder or Hub id (KHA or stock), or a GGUF file (dequantised).

Code shipped inside a model folder (`auto_map` pointing at its own .py files) never runs unless the user passed
`--trust-remote-code`. KHA checkpoints need none: kha_hf is installed, so its registered classes load them (the
folder's code files are only compared with the installed ones, to say when they differ).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
from pathlib import Path

import torch

from ..common.errors import KHAError
from ..modeling.configuration_kha import multimodal_text_type
from .checks import family_type, is_number
from .reader import Checkpoint, open_checkpoint, read_config_dict

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tiktoken.model")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


OFFLINE_HINT = "offline? set HF_HUB_OFFLINE=1 to use what is cached, or pass a local path"


def describe_error(err: BaseException) -> str:
    """The first line of ERR, plus a hint when the Hugging Face Hub could not be reached (no network)."""
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    chain, seen = err, set()
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        name = type(chain).__name__
        if name in ("ConnectError", "ConnectionError", "ConnectTimeout", "LocalEntryNotFoundError") or (
            "couldn't connect" in str(chain).lower() or "failed to resolve" in str(chain).lower()
        ):
            return f"{reason} ({OFFLINE_HINT})"
        chain = chain.__cause__ or chain.__context__
    return reason


def find_gguf(path: Path) -> Path | None:
    """The GGUF file that `path` is or holds (exactly one), else None."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise KHAError(f"{path} holds several GGUF files; name one: {', '.join(p.name for p in found)}")
        return found[0] if found else None
    return None


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise KHAError(f"unknown dtype {name!r}; choose one of: {', '.join(DTYPES)}")
    return DTYPES[name]


def check_device(device: str) -> str:
    """DEVICE if torch can use it here, else KHAError naming what is available."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as err:
        raise KHAError(f"unknown device {device!r}; use cpu, cuda, cuda:N or mps") from err
    if parsed.type == "cpu":
        return device
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise KHAError(f"device {device!r} is not available: this torch sees no CUDA GPU (use --device cpu)")
        if parsed.index is not None and parsed.index >= count:
            raise KHAError(f"device {device!r} does not exist: this machine has {count} CUDA device(s)")
        return device
    if parsed.type == "mps" and torch.backends.mps.is_available():
        return device
    raise KHAError(f"device {device!r} is not available on this machine (use --device cpu)")


def check_model_ref(ref: str | Path, what: str = "model") -> None:
    """A REF that is neither an existing path nor a Hub id is reported as a missing path (not as a Hub failure).

    `owner/name` counts as a Hub id unless `owner` is a local folder (then it is a path that does not exist).
    """
    text = str(ref)
    if Path(text).expanduser().exists():
        return
    if HUB_ID.match(text) and not Path(text.split("/", 1)[0]).is_dir():
        return  # a Hub id: loading says what the Hub answered
    raise KHAError(f"{what} {text!r}: no such file or folder (and not a Hub id of the form owner/name)")


def kha_code_matches_installed(folder: Path) -> bool:
    """True if FOLDER holds the three KHA code files, byte for byte those of the installed kha_hf."""
    from ..common.model_code import model_code_files

    for installed in model_code_files():
        copy = folder / installed.name
        if not copy.is_file() or _sha256(copy) != _sha256(installed):
            return False
    return True


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def remote_code_kwargs(
    ref: str | Path, trust_remote_code: bool = False, echo=print, checkpoint: Checkpoint | None = None
) -> dict:
    """`trust_remote_code` for transformers' from_pretrained: False unless the user asked for it.

    A KHA checkpoint loads through the installed kha_hf classes (registered with the Auto classes), so its own
    code files never need to run; when they differ from the installed copy, say so once. CHECKPOINT: REF's folder
    as the caller opened it (its config.json is not read again).
    """
    folder = Path(ref).expanduser()
    if checkpoint is not None:
        config = checkpoint.config
    else:
        config = read_config_dict(folder) if folder.is_dir() else None
    # The KHA classes are registered with the Auto classes by `import kha_hf`, or, under the `kha` command, right
    # after its arguments are parsed: before any command loads a model.
    if config and config.get("model_type") == "kha" and not trust_remote_code:
        if not kha_code_matches_installed(folder):
            echo(
                f"note: {folder} carries KHA code that differs from the installed kha_hf; loading it with the "
                "installed code (the folder's own code is not run)"
            )
    return {"trust_remote_code": bool(trust_remote_code)}


def check_hub_repo_id(repo_id: str, what: str = "REPO_ID") -> None:
    """A Hub repo id the Hub can accept ('owner/name' or 'name'), checked before any work."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise KHAError(
            f"{what} {repo_id!r} is not a valid Hub repo id (use owner/name): {describe_error(err)}"
        ) from None


def check_tokenizer_needs_no_code(folder: Path) -> None:
    """A folder whose tokenizer only its own code files can build (tokenizer_config.json's auto_map names a class
    transformers lacks) cannot become a KHA checkpoint: a KHA folder's tokenizer never runs code, so it would
    never load. Read from the JSON only; nothing of the folder runs."""
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    config = _json_dict(folder / "tokenizer_config.json") or {}  # none, or unreadable: loading says what is wrong
    auto_map = config.get("auto_map")
    if isinstance(auto_map, (list, tuple)):  # the oldest form: [slow, fast]
        auto_map = {"AutoTokenizer": auto_map}
    if not isinstance(auto_map, dict) or not auto_map.get("AutoTokenizer"):
        return
    name = config.get("tokenizer_class")
    known = False
    if isinstance(name, str):
        try:
            known = tokenizer_class_from_name(name) is not None or tokenizer_class_from_name(f"{name}Fast") is not None
        except Exception:  # a name transformers cannot resolve
            known = False
    if not known:
        raise KHAError(
            f"{folder}'s tokenizer needs its own code ({folder / 'tokenizer_config.json'}: auto_map AutoTokenizer, "
            f"tokenizer_class {name!r}); a KHA checkpoint never runs tokenizer code, so it could not load: convert a "
            "copy whose tokenizer_config.json names a tokenizer class transformers has"
        )


def check_processor_needs_no_code(folder: Path) -> None:
    """A KHA folder whose processor (processor_config.json / preprocessor_config.json) names code shipped in the
    folder (auto_map with a class transformers lacks) could never load it: a KHA checkpoint's processor runs no code.
    One-line KHAError; read from the JSON only, nothing of the folder runs."""
    import transformers

    def known(name) -> bool:  # a class transformers has (not any attribute: `logging` is a module)
        return isinstance(name, str) and isinstance(getattr(transformers, name, None), type)

    for name in PROCESSOR_FILES:
        config = _json_dict(folder / name)
        if config is None:
            continue  # none, or unreadable: loading the processor says what is wrong
        # the processor's own entries and those of the sub-processors it nests (image_processor, video_processor)
        parts = [config] + [value for value in config.values() if isinstance(value, dict)]
        for part in parts:
            auto_map = part.get("auto_map")
            if not auto_map:
                continue
            classes = [part.get(key) for key in ("processor_class", "image_processor_type", "video_processor_type")]
            named = [c for c in classes if c is not None]
            if not named or not all(known(c) for c in named):
                raise KHAError(
                    f"{folder}'s processor needs its own code ({folder / name}: auto_map); a KHA checkpoint never runs "
                    "processor code: use a copy whose processor names classes transformers has"
                )
    # AutoProcessor also reads tokenizer_config.json: its auto_map's processor entries and its processor_class
    # (used when processor_config.json names none; found by the round-5 attack: convert passed, serve crashed)
    tokenizer_config = _json_dict(folder / "tokenizer_config.json")
    if not has_processor_files(folder) or tokenizer_config is None:
        return
    auto_map = tokenizer_config.get("auto_map")
    processor_keys = ("AutoProcessor", "AutoImageProcessor", "AutoVideoProcessor", "AutoFeatureExtractor")
    named_code = isinstance(auto_map, dict) and any(key in auto_map for key in processor_keys)
    processor_class = tokenizer_config.get("processor_class")
    if named_code or (processor_class is not None and not known(processor_class)):
        raise KHAError(
            f"{folder}'s processor needs its own code ({folder / 'tokenizer_config.json'}: auto_map or "
            "processor_class); a KHA checkpoint never runs processor code: use a copy whose processor names "
            "classes transformers has"
        )


def _json_dict(path: Path) -> dict | None:
    """PATH's JSON object; None when it is missing, unreadable or not an object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _remote_code_error(ref, err: Exception) -> KHAError | None:
    text = str(err)
    if "trust_remote_code" in text:
        return KHAError(
            f"{ref} ships its own model code (auto_map); it was not run. "
            "Pass --trust-remote-code if you trust that code"
        )
    return None


def load_tokenizer(
    ref: str | Path,
    tokenizer: str | Path | None = None,
    trust_remote_code: bool = False,
    gguf=None,
    offer_trust: bool = True,
    offer_tokenizer: bool = True,
    checkpoint: Checkpoint | None = None,
):
    """The tokenizer of REF (or of TOKENIZER when given), with a one-line error that names --tokenizer.

    OFFER_TRUST / OFFER_TOKENIZER: the command has a --trust-remote-code / --tokenizer option, so an error may
    point to it (an error never advises an option the command lacks). CHECKPOINT: REF's folder as the caller
    opened it (its config.json is not read again)."""
    from transformers import AutoTokenizer

    source = tokenizer or ref
    if tokenizer is not None:
        check_model_ref(tokenizer, "tokenizer")
    folder = Path(source).expanduser()
    if gguf is None and folder.is_dir() and not any((folder / name).exists() for name in TOKENIZER_FILES):
        raise KHAError(
            f"{folder} has no tokenizer files"
            + (
                "; pass --tokenizer NAME_OR_PATH (e.g. the base model it was converted from)"
                if offer_tokenizer and not tokenizer
                else ""
            )
        )
    if checkpoint is not None and tokenizer is None:
        config = checkpoint.config
    else:
        config = read_config_dict(folder) if folder.is_dir() else None
    if (config or {}).get("model_type") == "kha":
        trust_remote_code = False  # a KHA folder's tokenizer is its base model's: none of the folder's code runs
        offer_trust = False
    try:
        if gguf is not None and tokenizer is None:
            return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as err:
        if "trust_remote_code" in str(err) and not offer_trust:
            raise KHAError(
                f"cannot load a tokenizer from {source}: it needs tokenizer code shipped in the folder (auto_map), "
                "which this command never runs"
                + ("; pass --tokenizer NAME_OR_PATH to use another one" if offer_tokenizer else "")
            ) from err
        reason = _remote_code_error(source, err) or describe_error(err)
        raise KHAError(
            f"cannot load a tokenizer from {source}: {reason}"
            + ("" if tokenizer or not offer_tokenizer else "; pass --tokenizer NAME_OR_PATH to use another one")
        ) from err
    except Exception as err:
        # a tokenizer.json that is JSON but not a tokenizer: transformers' KeyError ('added_tokens'), or tokenizers'
        # bare Exception from Rust ("data did not match any variant of untagged enum ...", tokenizers 0.23)
        raise KHAError(f"cannot load a tokenizer from {source}: not a valid tokenizer ({describe_error(err)})") from err


# A multimodal checkpoint's image processor: one of these files (beside the tokenizer's)
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def has_processor_files(folder: Path) -> bool:
    """True when FOLDER holds an image processor's config (a multimodal checkpoint can then take images)."""
    return any((folder / name).is_file() for name in PROCESSOR_FILES)


# Bounds on what a processor's JSON may ask of one image (`check_processor_bounds`). Every released processor fits
# them: resize targets are at most a few thousand pixels a side (Gemma 3 896, Llama 4 336, Idefics3 1456, Pixtral
# 1024, Mistral 3 1540), pixel budgets at most 4096 x 4096 (Qwen2-VL and Qwen2.5-VL max_pixels 12,845,056 = 3584^2,
# Qwen3-VL's size.longest_edge 16,777,216 = 4096^2, GLM-4V 9,633,792), crops and tiles a few dozen (Gemma 3
# pan_and_scan_max_num_crops 4, Mllama max_image_tiles 4, InternVL max_dynamic_patch 12, Phi-4-MM dynamic_hd 36),
# patches a few thousand (Pix2Struct max_patches 2048, SigLIP 2 max_num_patches 256). A 28 x 28 PNG resized to
# 20000 x 20000 takes gigabytes: such a processor is refused before anything loads.
MAX_PROCESSOR_SIDE = 4096
MAX_PROCESSOR_PIXELS = 4096 * 4096
MAX_PROCESSOR_CROPS = 64
MAX_PROCESSOR_PATCHES = 16384
PROCESSOR_CROP_KEYS = (
    "pan_and_scan_max_num_crops", "max_image_tiles", "max_num_tiles", "max_dynamic_patch", "max_crops",
    "max_num_crops", "dynamic_hd",
)  # fmt: skip
PROCESSOR_PATCH_KEYS = ("max_patches", "max_num_patches")
# tokens one image becomes, as processors read them from their config (Gemma 3: 256, Idefics3: 169, SmolVLM: 64)
PROCESSOR_TOKEN_KEYS = ("image_seq_length", "num_image_tokens", "mm_tokens_per_image", "image_seq_len")
MAX_PROCESSOR_IMAGE_TOKENS = 16384
MIN_PROCESSOR_PATCH = 4  # pixels a side of a vision patch (released processors: 14 to 32)
SIDE_KEYS = ("height", "width", "shortest_edge", "longest_edge", "max_height", "max_width")
# image processors whose size.shortest_edge / longest_edge count pixels, not a side (Qwen-VL, GLM-4V and kin)
PIXEL_SIZE_CLASSES = re.compile(r"qwen|glm|keye|paddleocr", re.IGNORECASE)


def check_processor_bounds(folder: Path) -> None:
    """One-line KHAError when FOLDER's processor (processor_config.json / preprocessor_config.json) would resize an
    image past the bounds above (a side, a pixel budget, a number of crops, tiles or patches): one small image would
    otherwise cost the server gigabytes. Read from the JSON only; videos (video_processor) are not served."""
    config_dict = read_config_dict(folder) or {}
    model_types = " ".join(str(config_dict.get(key, "")) for key in ("model_type", "base_model_type"))
    for name in PROCESSOR_FILES:
        config = _json_dict(folder / name)
        if config is None:
            continue
        parts = [config] + [
            value for key, value in config.items() if isinstance(value, dict) and "video" not in key.lower()
        ]
        named = ("image_processor_type", "processor_class")
        classes = " ".join(str(part.get(key, "")) for part in parts for key in named)
        pixel_sizes = bool(PIXEL_SIZE_CLASSES.search(f"{classes} {model_types}"))
        refuse = functools.partial(_refuse_processor, folder / name)

        for part in parts:
            for key, value in part.items():
                if not isinstance(key, str) or "video" in key.lower():
                    continue
                if "pixels" in key and is_number(value) and value > MAX_PROCESSOR_PIXELS:
                    refuse(key, value, MAX_PROCESSOR_PIXELS, "pixels")
                if key in PROCESSOR_CROP_KEYS and is_number(value) and value > MAX_PROCESSOR_CROPS:
                    refuse(key, value, MAX_PROCESSOR_CROPS, "crops")
                if key in PROCESSOR_PATCH_KEYS and is_number(value) and value > MAX_PROCESSOR_PATCHES:
                    refuse(key, value, MAX_PROCESSOR_PATCHES, "patches")
                if key in PROCESSOR_TOKEN_KEYS and is_number(value) and value > MAX_PROCESSOR_IMAGE_TOKENS:
                    # Gemma 3's processor builds its image-token string of this length when it is created
                    refuse(key, value, MAX_PROCESSOR_IMAGE_TOKENS, "tokens per image")
                if key == "patch_size":
                    sides = value.values() if isinstance(value, dict) else [value]
                    if any(is_number(side) and side < MIN_PROCESSOR_PATCH for side in sides):
                        raise KHAError(
                            f"{folder / name}: patch_size = {value!r} is below the {MIN_PROCESSOR_PATCH} pixels of any "
                            "released processor; one image would become millions of tokens: fix the processor's config"
                        )
                if not key.endswith("size"):
                    continue
                if isinstance(value, dict):
                    for side, number in value.items():
                        if side not in SIDE_KEYS or not is_number(number):
                            continue
                        in_pixels = pixel_sizes and side in ("shortest_edge", "longest_edge")
                        bound = MAX_PROCESSOR_PIXELS if in_pixels else MAX_PROCESSOR_SIDE
                        if number > bound:
                            refuse(f"{key}.{side}", number, bound, "pixels" if in_pixels else "pixels a side")
                    continue
                numbers = value if isinstance(value, list) else [value]
                for number in numbers:
                    if is_number(number) and number > MAX_PROCESSOR_SIDE:
                        refuse(key, value, MAX_PROCESSOR_SIDE, "pixels a side")


def _refuse_processor(path: Path, key: str, value, bound: int, what: str):
    raise KHAError(
        f"{path}: {key} = {value!r} {what}, over the {bound:,} of any released processor; one small image would "
        "cost the server gigabytes: fix the processor's config"
    )


def is_multimodal_checkpoint(folder: Path) -> bool:
    """True when FOLDER's config.json is a multimodal model around a text decoder (stock or KHA): gemma3, ..."""
    return multimodal_text_type(family_type(read_config_dict(folder) or {})) is not None


def load_causal_lm(
    ref: str | Path,
    dtype: str = "float32",
    device: str = "cpu",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    tokenizer: str | Path | None = None,
    offer_tokenizer: bool = True,
    checked: Checkpoint | None = None,
):
    """(model, tokenizer) for REF, in eval mode on DEVICE; code inside REF runs only with `trust_remote_code`.
    OFFER_TOKENIZER: the command has a --tokenizer option (errors may advise it). CHECKED: REF's folder as the
    caller opened it (`open_checkpoint(..., trust_remote_code=..., causal_lm=True)`): not read or checked again."""
    from transformers import AutoModelForCausalLM

    check_model_ref(ref)
    check_device(device)
    path = Path(ref).expanduser()
    gguf = find_gguf(path) if path.exists() else None
    checkpoint = checked
    if gguf is None and path.is_dir() and checkpoint is None:  # checked before anything is built: one line
        checkpoint = open_checkpoint(path, trust_remote_code=trust_remote_code, causal_lm=True)
    if gguf is not None:
        from .gguf_header import check_gguf_header

        check_gguf_header(gguf)  # the same for a GGUF file's metadata, before transformers' loader allocates
    # first: cheap, and its errors are the common ones
    tok = load_tokenizer(
        ref, tokenizer, trust_remote_code, gguf, offer_tokenizer=offer_tokenizer, checkpoint=checkpoint
    )
    kwargs = {"dtype": torch_dtype(dtype)}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    auto = AutoModelForCausalLM
    if checkpoint is not None and checkpoint.is_multimodal:
        from transformers import AutoModelForImageTextToText  # Qwen2.5-VL has no AutoModelForCausalLM entry

        auto = AutoModelForImageTextToText
    try:
        with _LoadReport() as report:
            if gguf is not None:
                model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, **kwargs)
            else:
                kwargs.update(remote_code_kwargs(ref, trust_remote_code, checkpoint=checkpoint))
                model = auto.from_pretrained(ref, **kwargs)
    except (OSError, ValueError) as err:
        remote = _remote_code_error(ref, err)
        if remote is not None:
            raise remote from err
        raise KHAError(f"cannot load model {str(ref)!r}: {describe_error(err)}") from err
    except RuntimeError as err:  # a weight of another size than the model has: transformers raises after its report
        mismatch = report.size_mismatch(str(err))
        if mismatch is None:
            raise
        raise KHAError(f"cannot load model {str(ref)!r}: {mismatch}") from err
    return model.to(device).eval(), tok


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_SIZE = r"torch\.Size\((\[[^\]]*\])\)"
# transformers' load report row (`name | MISMATCH | Reinit due to size mismatch - ckpt: ... vs model:...`; a narrow
# terminal's report has no shapes) and the older state_dict error (`size mismatch for name: copying a param ...`)
_REPORT_ROW = re.compile(rf"^\s*([\w.]+)\s*\|\s*MISMATCH\b(?:.*?ckpt: {_SIZE} vs model:\s*{_SIZE})?", re.MULTILINE)
_STATE_DICT = re.compile(
    rf"size mismatch for ([\w.]+): copying a param with shape {_SIZE} from checkpoint, "
    rf"the shape in current model is {_SIZE}"
)


class _LoadReport(logging.Handler):
    """transformers' warnings while a model loads: its load report names a weight whose size the model does not
    have, which its RuntimeError ("You set `ignore_mismatched_sizes` to `False`...") leaves to the report."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.text: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.text.append(_ANSI.sub("", record.getMessage()))

    def __enter__(self):
        logging.getLogger("transformers").addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("transformers").removeHandler(self)

    def size_mismatch(self, error: str) -> str | None:
        """One line naming the first weight stored with another size than the model has, or None when ERROR is not
        a size mismatch."""
        match = _STATE_DICT.search(error)
        if match is None and "mismatch" in error:
            match = _REPORT_ROW.search("\n".join(self.text))
        if match is None:  # a report not logged (transformers' verbosity) still says what went wrong, in one line
            return "a weight is stored with another shape than its config.json gives" if "mismatch" in error else None
        name, stored, model = match.groups()
        if stored is None:
            return f"{name} is stored with another shape than the model its config.json describes"
        return f"{name} is stored with shape {stored}; the model its config.json describes has {model}"
