"""`kha convert`: stream-upgrade a base checkpoint to KHA by adding identity knock tensors.

The model is never built: tensor headers give the layout, the original shards are linked or copied byte for byte,
and the knocks go into one extra safetensors file listed in a merged index. Peak memory is that of the interpreter
(plus one shard when `dtype` asks for a cast), whatever the checkpoint's size. GGUF sources are the exception:
they are dequantised through transformers first (see `source.dequantize_gguf`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..checkpoint.adapter_knocks import TrainedKnocks, adapter_kha_config, adapter_knocks
from ..checkpoint.checks import architectures_of
from ..checkpoint.knock_tensors import initial_knock_tensors
from ..checkpoint.loading import (
    PROCESSOR_FILES,
    TOKENIZER_FILES,
    check_hub_repo_id,
    check_processor_bounds,
    check_processor_needs_no_code,
    check_tokenizer_needs_no_code,
    torch_dtype,
)
from ..checkpoint.output import atomic_output_dir, carry_over_files, check_free_space, place_file, report_placement
from ..checkpoint.paths import check_destination, check_source_links
from ..checkpoint.reader import open_checkpoint
from ..checkpoint.safetensors_index import INDEX_FILE, SINGLE_FILE, shard_files
from ..common.errors import KHAError
from ..common.model_card import SourceCard, kha_card, read_source_card
from ..common.model_code import copy_model_code
from ..common.version import __version__
from ..modeling.configuration_kha import (
    CONTROL_PRESETS,
    DEFAULT_KNOCK,
    KHAConfig,
    base_config_class,
    control_refusal,
    kha_architecture,
    multimodal_text_type,
    resolve_knock_preset,
)
from ..modeling.families import family_spec
from ..modeling.modeling_kha import KNOCKS_FILE
from .source import Source, dequantize_gguf, resolve_source

CONVERTED = (
    "This checkpoint is {base} upgraded to Knocking-Heads Attention by `kha convert`. The knocks start at the "
    "identity, so before any training it computes exactly what the base model computes."
)
FROM_ADAPTER = (
    "This checkpoint is {base} with Knocking-Heads Attention, its knocks taken from a knock adapter (PEFT) trained "
    "on it, written by `kha convert --adapter`."
)
SINGLE_SHARD = "model-00001-of-00001.safetensors"
REQUIRED_FIELDS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")


@dataclass
class ConversionResult:
    output: Path
    base_model: str
    config: KHAConfig
    knock_tensors: list[str] = field(default_factory=list)
    shards: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # what a usable model of its kind lacks (a processor)


def convert(
    src: str | Path,
    dst: str | Path,
    knock: str | None = None,
    knock_layers: list[int] | None = None,
    link: bool = False,
    dtype: str | None = None,
    verify: bool = False,
    push_to_hub: str | None = None,
    private: bool = False,
    overwrite: bool = False,
    revision: str | None = None,
    token: str | None = None,
    progress: bool = True,
    trained_knocks: TrainedKnocks | str | Path | None = None,
) -> ConversionResult:
    """Upgrade SRC (folder, Hub id or .gguf) to a KHA checkpoint in DST with identity knocks.

    Args:
        knock: preset name (mlp_v, the default, linear_v, linear_qkv, mlp_v_linear_qk).
        knock_layers: layer indices to knock (default: all).
        link: hard-link the original shards instead of copying them (symlink across file systems).
        dtype: cast weights to float32/bfloat16/float16 (rewrites shards one at a time); default: keep.
        verify: load base and KHA models and require identical logits before DST is put in place.
        push_to_hub: upload the finished folder to this Hub repo id.
        trained_knocks: knocks trained on SRC elsewhere, a knock adapter's folder (or what
            `kha_hf.peft.read_knock_adapter(dir)` read of it): DST gets them instead of identities, with their knock
            types and layers (KNOCK and KNOCK_LAYERS must then be left unset).
        src: the base checkpoint: a local folder, a Hub id (`revision`, `token`) or a `.gguf` file.
        dst: the output folder; it appears only when complete.
        private: make the `push_to_hub` repository private.
        overwrite: replace an existing DST, only one a kha tool wrote (its `.kha-output` marker); default False.
        revision: the Hub revision of SRC.
        token: a Hub token (default: the one huggingface_hub finds).
        progress: show progress bars (default True).

    Returns:
        A `ConversionResult`: `output` (DST), `base_model`, the written `config` (a `KHAConfig`), the knock tensors
        and shards written, and `missing`: what a usable model of its kind lacks (e.g. a multimodal model's
        processor files).

    Raises:
        KHAError: in one line, before DST appears: an unknown preset, a family KHA does not support, a config that
            does not describe the weights, pickle weights, a link out of SRC, a DST that exists (without
            `overwrite`) or lies inside SRC, too little free space, or (`verify`) logits that differ.
    """
    if push_to_hub:
        check_hub_repo_id(push_to_hub, "--push-to-hub")  # before converting, not after
    local_src = Path(src).expanduser()
    if local_src.is_dir():  # a KHA folder never runs tokenizer or processor code, nor resizes an image to gigabytes
        check_tokenizer_needs_no_code(local_src)
        check_processor_needs_no_code(local_src)
        check_processor_bounds(local_src)
    knocks_from = trained_knocks
    if isinstance(knocks_from, (str, Path)):  # read before SRC is
        from ..peft.adapter_files import read_knock_adapter

        knocks_from = read_knock_adapter(knocks_from)
    if knocks_from is not None:
        if knock is not None or knock_layers is not None:
            raise KHAError("--adapter sets the knocks: leave --knock and --knock-layers out")
        if verify:
            raise KHAError("--verify checks identity knocks; an adapter's trained knocks change the outputs")
    knock = DEFAULT_KNOCK if knock is None and knocks_from is None else knock
    try:
        if knocks_from is None and knock.endswith("_random"):  # kha ab's variant: random knocks change the outputs
            what = f"knock {knock} draws the knocks at random, which changes the model's outputs"
            raise KHAError(control_refusal(what, "kha convert"))
        if knocks_from is None and resolve_knock_preset(knock) and knock in CONTROL_PRESETS:  # before any download
            raise KHAError(control_refusal(f"--knock {knock} is the gate-only value knock", "kha convert"))
    except ValueError as err:
        raise KHAError(str(err)) from err
    if dtype is not None:
        torch_dtype(dtype)  # a name torch has, checked before any download
    if str(dst).lower().endswith(".gguf"):  # it would be a folder named like a file
        raise KHAError(
            f"{dst}: kha convert writes a checkpoint folder, not a GGUF file; for llama.cpp, fold a KHA-Linear "
            "model into one (kha fold KHA_DIR OUT.gguf)"
        )
    read = [knocks_from.folder] if knocks_from is not None and knocks_from.folder is not None else []
    dst = check_destination(dst, [local_src, *read] if local_src.exists() else read, overwrite)  # before downloading
    source = resolve_source(src, revision=revision, token=token)
    check_destination(dst, [source.gguf_file or source.folder, *read], overwrite)
    # no link out of SRC: nothing from elsewhere is copied into DST (of a GGUF's folder, only its card is read)
    gguf_card = [name for name in ("README.md",) if os.path.lexists(source.folder / name)]
    check_source_links(source.folder, gguf_card if source.gguf_file is not None else None)
    card = read_source_card(
        source.gguf_file.parent if source.gguf_file else source.folder, source.hub_repo, source.gguf_file
    )
    with atomic_output_dir(dst, overwrite=overwrite, marker="convert") as out, ExitStack() as temporary:
        folder_source, what = source, source.name
        if source.gguf_file is not None:
            # inside the temporary output: removed with it whatever happens
            dequantised = Path(temporary.enter_context(tempfile.TemporaryDirectory(prefix=".gguf-", dir=out)))
            if progress:
                print(f"dequantising {source.gguf_file.name} (GGUF is read whole, through transformers)")
            dequantize_gguf(source.gguf_file, dequantised)
            folder_source, what = Source(dequantised, source.name), f"{source.gguf_file.name} (dequantised)"
            link = True  # the dequantised shards are ours to give away (they vanish with the temporary folder)
        result = _convert_folder(folder_source, out, knock, knock_layers, link, dtype, progress, card, knocks_from)
        if verify:  # a GGUF against what it loads as, already on disk: not dequantised a second time
            from .verify import verify_conversion

            print(f"verifying: loading {what} and the KHA checkpoint, comparing logits and greedy tokens")
            # kha convert has no --tokenizer
            verify_conversion(folder_source.folder, out, dtype=dtype or "float32", offer_tokenizer=False)
    result.output = dst.absolute()
    if push_to_hub:
        from .hub import push_folder

        push_folder(result.output, push_to_hub, private=private, token=token)
    return result


def check_base_config(base_config: dict, folder: Path) -> None:
    """`open_checkpoint`'s ACCEPT for `kha convert`: a base (not KHA) model of a family KHA knows, with a head KHA
    has a class for, and the fields the conversion reads."""
    model_type = base_config.get("model_type")
    if not isinstance(model_type, str):
        return  # refused in one line by the config's checks, which run next (`checks.check_config_values`)
    if model_type == KHAConfig.model_type:
        raise KHAError(f"{folder} is already a KHA checkpoint (model_type 'kha')")
    try:
        base_config_class(model_type)
        # a head KHA lacks is refused, not dropped
        kha_architecture(architectures_of(base_config, str(folder / "config.json")), model_type)
    except ValueError as err:
        raise KHAError(f"{folder}: {err}") from err
    if multimodal_text_type(model_type) is not None:  # its text decoder's fields may be left to their defaults
        if not isinstance(base_config.get("text_config"), dict):
            raise KHAError(f"{folder / 'config.json'}: a {model_type} model needs a text_config object")
    else:
        missing = [name for name in REQUIRED_FIELDS if name not in base_config]
        if missing:
            raise KHAError(f"{folder / 'config.json'} lacks required fields: {', '.join(missing)}")


def check_buildable(config: KHAConfig) -> None:
    """A model type that is not in the family table must be buildable: its attention code follows a known layout."""
    if config.is_multimodal or not family_spec(config.knock_config.base_model_type).verified:
        from ..modeling.modeling_kha import family_classes

        try:
            family_classes(config.base_model_type)
            family_classes(config.knock_config.base_model_type)
        except ValueError as err:
            raise KHAError(str(err)) from err


def _convert_folder(
    source: Source,
    out: Path,
    knock: str,
    knock_layers: list[int] | None,
    link: bool,
    dtype: str | None,
    progress: bool,
    card: SourceCard,
    knocks_from: TrainedKnocks | None = None,
) -> ConversionResult:
    def kha_config(base_config: dict, folder: Path) -> KHAConfig:  # `open_checkpoint`'s BUILD
        try:
            if knocks_from is None:
                return KHAConfig.from_base(base_config, knock=knock, knock_layers=knock_layers)
            return adapter_kha_config(base_config, knocks_from, folder)
        except KHAError:
            raise
        except Exception as err:  # the family's config class rejects what it cannot use, in its own words
            raise KHAError(f"invalid {folder / 'config.json'}: {err}") from err

    # read and checked, once: its config, then the weights against the KHA model it will be
    checkpoint = open_checkpoint(source.folder, True, accept=check_base_config, build=kha_config)
    base_config, config = checkpoint.config, checkpoint.model_config
    tensors, prefix = checkpoint.tensors, checkpoint.prefix
    check_buildable(config)

    floats = Counter(info.dtype for info in tensors.values() if info.dtype.is_floating_point)
    source_dtype = floats.most_common(1)[0][0] if floats else torch.float32
    target_dtype = torch_dtype(dtype) if dtype else source_dtype
    knocks = initial_knock_tensors(config, target_dtype, prefix)
    if knocks_from is not None:  # checked against what the KHA model needs before any shard is written
        knocks = adapter_knocks(knocks, knocks_from.tensors, source.name)
    shards = shard_files(tensors)
    if KNOCKS_FILE in shards:
        raise KHAError(f"{source.folder} already has a shard named {KNOCKS_FILE}, the file kha writes the knocks to")
    # transformers reads model.safetensors in preference to an index, so a single-file source gets a shard name
    renamed = {SINGLE_FILE: SINGLE_SHARD} if shards == [SINGLE_FILE] else {}
    to_cast = {info.file for info in tensors.values() if info.dtype.is_floating_point and info.dtype != target_dtype}
    needed = sum((source.folder / name).stat().st_size for name in shards if name in to_cast or not link)
    check_free_space(out, needed + (1 << 20), f"the shards of {source.name}")
    placed = []
    for name in tqdm(shards, desc="shards", unit="shard", disable=not progress):
        target = out / renamed.get(name, name)
        if name in to_cast:
            _write_cast_shard(source.folder / name, target, target_dtype)
        else:
            placed.append(place_file(source.folder / name, target, link))
    report_placement(placed)

    metadata = {"format": "pt", "kha_knock_preset": config.knock_preset or "custom", "kha_hf_version": __version__}
    save_file(knocks, out / KNOCKS_FILE, metadata=metadata)
    weight_map = {name: renamed.get(info.file, info.file) for name, info in tensors.items()}
    weight_map.update(dict.fromkeys(knocks, KNOCKS_FILE))
    total = sum(
        math.prod(info.shape) * (target_dtype if info.dtype.is_floating_point else info.dtype).itemsize
        for info in tensors.values()
    )
    total += sum(t.numel() * t.element_size() for t in knocks.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    config.dtype = target_dtype
    # the causal LM, or the task head of a reward model / classifier, which keeps its head's tensors
    config.architectures = [kha_architecture(base_config.get("architectures"), config.base_model_type)]
    config.to_json_file(out / "config.json")
    copy_model_code(out)
    carried = carry_over_files(source.folder, out)
    missing = []
    if config.is_multimodal and not set(carried) & set(PROCESSOR_FILES):
        # the weights, config and tokenizer are still written: the processor can be added next to them later
        missing.append("processor")
        print(
            f"note: {source.name} has no image processor ({' / '.join(PROCESSOR_FILES)}): the KHA checkpoint has "
            f"the model{' and its tokenizer' if set(carried) & set(TOKENIZER_FILES) else ''}; copy those files from "
            "the base model's repository to feed it images",
            file=sys.stderr,
        )
    title = f"{card.base_model or source.name} with Knocking-Heads Attention"
    (out / "README.md").write_text(kha_card(config, card, title, CONVERTED if knocks_from is None else FROM_ADAPTER))
    shard_names = [renamed.get(s, s) for s in shards]
    return ConversionResult(out, source.name, config, sorted(knocks), shard_names, missing)


def _write_cast_shard(src: Path, dst: Path, dtype: torch.dtype) -> None:
    """Rewrite one shard with floating tensors cast to `dtype` (holds one shard in memory)."""
    with safe_open(src, framework="pt") as f:
        metadata = f.metadata() or {"format": "pt"}
        tensors = {}
        for key in f.keys():
            tensor = f.get_tensor(key)
            tensors[key] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    save_file(tensors, dst, metadata=metadata)
