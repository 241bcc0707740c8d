"""`kha fold KHA_DIR OUT.gguf`: the folded model as one GGUF file that llama.cpp (Ollama, LM Studio) runs as it is.

The fold is `fold.py`'s rule (per head, float64, `fold_projection`); what this module adds is llama.cpp's view of a
checkpoint, after llama.cpp's own convert_hf_to_gguf.py (as vendored by llama-cpp-python 0.3.36):
- tensor names from gguf's per-architecture map (`get_tensor_name_map`); Llama/Mistral q/k rows permuted per head
  (llama.cpp's rotary pairs are adjacent, transformers' are half a head apart); Gemma 3's norms stored as `1 + w`
  (transformers computes `x * (1 + w)`, llama.cpp `x * w`; the embedding scale sqrt(hidden) is in llama.cpp's graph);
  Phi-3's fused qkv_proj / gate_up_proj written as they are (llama.cpp splits them);
- metadata: context, sizes, heads, RoPE (base, scaling, dimensions), norm epsilon, sliding windows, and the tokenizer
  with its chat template (`gguf_vocab`), so llama.cpp needs no other file;
- 1-D tensors and norms in float32 (as llama.cpp's converter writes them); matrices in the chosen type: f32, f16,
  bf16 or q8_0 (gguf's own Q8_0, bit-exact with ggml's; a row whose length is not a multiple of 32 falls back to f16).
Anything llama.cpp's graph for the family would compute differently (a sliding window its graph lacks, a query
scale it does not take) is refused with one line, not written approximately.

Streaming: tensor infos come from the safetensors headers; the data is then read, folded, converted and written one
tensor at a time; a large matrix that needs only its type changed (the embedding, MLP weights) is read, converted
and written ROW_BLOCK rows at a time (`StreamedArray`), so memory is about the largest attention tensor, never the
model. The file is written to a temporary name beside OUT and renamed when complete
(`checkpoint.output.atomic_output_file`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from ..checkpoint.knock_reader import KHACheckpoint, kha_config
from ..checkpoint.knock_tensors import KNOCK_KEY
from ..checkpoint.output import atomic_output_file, check_free_space
from ..checkpoint.paths import check_file_destination, check_place, check_source_links
from ..checkpoint.reader import Checkpoint, open_checkpoint
from ..common.errors import KHAError
from ..common.version import __version__
from ..modeling.configuration_kha import TARGET_WORDS, control_refusal, mlp_knocks_phrase
from .fold_plan import checked_fold_plan, fold_checked
from .gguf_pretokenizers import KNOWN_PRE_TYPES

# --outtype -> gguf.LlamaFileType's name; the matrices' gguf.GGMLQuantizationType is the outtype's upper case
FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}
OUTTYPES = ("auto", *FILE_TYPES)
GGUF_MAGIC = b"GGUF"
# Metadata key of every GGUF file kha writes: --overwrite replaces only such files (as folders need kha's marker)
KHA_GGUF_MARKER = "kha.written_by"
ROW_BLOCK = 4096  # rows converted at a time: bounds the conversion's temporaries for a large embedding


@dataclass(frozen=True)
class Family:
    arch: str  # llama.cpp's architecture name (general.architecture)
    permute_qk: bool = False  # Llama's rotary layout: q/k rows reordered per head
    norm_shift: float = 0.0  # added to every norm weight (Gemma's `1 + w`)


# transformers model_type -> how llama.cpp runs it (the families kha's GGUF export reproduces exactly)
FAMILIES: dict[str, Family] = {
    "llama": Family("llama", permute_qk=True),
    "mistral": Family("llama", permute_qk=True),
    "qwen2": Family("qwen2"),
    "qwen3": Family("qwen3"),
    "phi3": Family("phi3"),
    "gemma3_text": Family("gemma3", norm_shift=1.0),
}


@dataclass
class GGUFResult:
    output: Path
    folded: list[str]  # knock tensors absorbed
    arch: str  # llama.cpp architecture
    outtype: str
    size: int  # bytes
    warnings: list[str]
    kept_kha = False  # a GGUF file is always fully folded

    @property
    def summary(self) -> str:
        """What `kha fold` prints: the notes, then the file written."""
        notes = "".join(f"note: {warning}\n" for warning in self.warnings)
        return (
            f"{notes}wrote {self.output}: GGUF for llama.cpp (architecture {self.arch}, {self.outtype}, "
            f"{self.size / 2**20:.1f} MiB), {len(self.folded)} knock tensors folded"
        )


@dataclass
class _Tensor:
    source: str  # safetensors name ("" for a generated tensor)
    name: str  # GGUF name
    shape: tuple[int, ...]  # logical (numpy order)
    qtype: object  # gguf.GGMLQuantizationType
    nbytes: int
    data: torch.Tensor | None = None  # a generated tensor's values


def export_gguf(
    kha_dir: str | Path,
    out: str | Path,
    outtype: str = "auto",
    overwrite: bool = False,
    tokenizer_pre: str | None = None,
    progress: bool = True,
    partial: bool = False,
    link: bool = False,
) -> GGUFResult:
    """Fold KHA_DIR's linear knocks (a plain checkpoint of a supported family needs none) and write OUT.gguf.
    PARTIAL and LINK, `kha fold`'s folder-only options, are refused."""
    try:
        import gguf
    except ImportError as err:
        raise KHAError("writing GGUF needs the gguf package: pip install 'kha-hf[gguf]' (or gguf>=0.19)") from err

    from .gguf_vocab import read_vocab

    refuse_folder_options(partial, link)
    kha_dir = Path(kha_dir)
    if outtype not in OUTTYPES:
        raise KHAError(f"unknown GGUF type {outtype!r}; choose one of {', '.join(OUTTYPES)}")
    out = check_place(out, [kha_dir])
    check_gguf_destination(out, overwrite)
    if not kha_dir.is_dir():
        raise KHAError(f"{kha_dir} is not a folder: KHA_DIR must be a checkpoint folder")
    check_source_links(kha_dir)
    not_lm = (
        "not a causal LM: the GGUF export writes language models only; fold it to a folder (`kha fold KHA_DIR OUT`) "
        "and run it with transformers"
    )
    checkpoint = open_checkpoint(kha_dir, True, accept=_known_type, build=_gguf_config, causal_lm=not_lm)
    warnings: list[str] = []
    kha = KHACheckpoint.of(checkpoint) if checkpoint.is_kha else None
    base, model_type, linear = checkpoint.base_config, checkpoint.model_type, []
    if kha is not None:
        config = kha.config
        if config.control_knocks:
            raise KHAError(control_refusal(f"{kha_dir}: {config.control_knocks}", "the GGUF export"))
        mlps = config.nonlinear_targets
        if mlps:
            raise KHAError(
                f"{mlp_knocks_phrase(mlps)} (KHA-MLP): llama.cpp has no {'/'.join(TARGET_WORDS[t] for t in mlps)}-MLP "
                f"graph, and a non-linear knock cannot be folded into {'/'.join(f'{t}_proj' for t in mlps)}, so no "
                "GGUF file can compute this model; use a linear preset (--knock linear_v or linear_qkv) for a model "
                "that folds into GGUF, or serve this one with `kha serve` or vLLM's Transformers backend"
            )
        linear = [t for t in ("q", "k", "v") if getattr(config, f"knock_{t}") == "linear"]
        model_type = config.base_model_type
    family = FAMILIES.get(model_type)
    if family is None:
        raise KHAError(
            f"{model_type!r}: kha's GGUF export writes only the families whose llama.cpp graph it reproduces exactly "
            f"({', '.join(sorted(FAMILIES))}); for this one, fold to a folder (`kha fold KHA_DIR OUT`) and use "
            "llama.cpp's convert_hf_to_gguf.py if llama.cpp supports it"
        )
    tensors = checkpoint.tensors
    plan, folded = checked_fold_plan(kha, linear) if kha is not None else ({}, [])
    if kha is None and any(KNOCK_KEY.match(n) for n in tensors):
        raise KHAError(f"{kha_dir}: knock tensors in a checkpoint whose config.json is not a KHA config")

    check_checkpoint_tensors(checkpoint)
    check_metadata_ranges(base, kha_dir)
    if tokenizer_pre is not None and tokenizer_pre not in KNOWN_PRE_TYPES:
        raise KHAError(
            f"--tokenizer-pre {tokenizer_pre!r} is not a pre-tokenizer type llama.cpp knows; choose one of "
            f"{', '.join(sorted(KNOWN_PRE_TYPES))}"
        )
    if outtype == "auto":
        outtype = _checkpoint_outtype(tensors)
    hparams, generated = _hparams(base, model_type, family, warnings, gguf)
    vocab, special_vocab = read_vocab(kha_dir, base.vocab_size, tokenizer_pre)
    plan_tensors = _plan_tensors(tensors, base, family, outtype, gguf, kha_dir) + generated
    total = sum(t.nbytes for t in plan_tensors)

    with atomic_output_file(out, overwrite=overwrite) as tmp:
        check_free_space(tmp.parent, total, f"the GGUF file {out.name}")
        writer = gguf.GGUFWriter(tmp, family.arch)
        try:
            writer.add_type(gguf.GGUFType.MODEL)
            writer.add_name(kha_dir.resolve().name)
            writer.add_string(KHA_GGUF_MARKER, f"kha-hf {__version__}")
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
            writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[outtype]])
            for key, value in [*hparams.items(), *vocab.items()]:
                getattr(writer, f"add_{key}")(value)
            special_vocab.add_to_gguf(writer, quiet=True)
            for t in plan_tensors:
                writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
            writer.write_header_to_file(tmp)
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            # the bar only on a terminal (disable=None): an error then stays the one line it is
            with tqdm(
                total=len(plan_tensors), desc="write GGUF", unit="tensor", disable=None if progress else True
            ) as bar:
                for data in _tensor_data(kha_dir, tensors, plan_tensors, plan, base, family, gguf):
                    writer.write_tensor_data(data)
                    bar.update()
        except OSError as err:
            if err.errno is not None:
                raise
            # numpy's tofile reports a short write without an errno ("81920 requested and 48000 written")
            raise KHAError(
                f"cannot write {out.name}: only part of a write reached the file ({err}): the disk is full or a "
                "file-size limit (ulimit -f) is set; nothing was written"
            ) from err
        finally:
            writer.close()  # also on an error: the temporary file is then removed
    return GGUFResult(out, folded, family.arch, outtype, out.stat().st_size, warnings)


def refuse_folder_options(partial: bool, link: bool) -> None:
    """`kha fold`'s folder-only options, refused for a GGUF output."""
    if partial:
        raise KHAError(
            "--partial keeps the value MLP, which llama.cpp cannot run: a GGUF output takes fully foldable models"
        )
    if link:
        raise KHAError("--link does not apply to a GGUF output (one new file is written)")


def check_gguf_destination(out: Path, overwrite: bool) -> None:
    """The destination rules of every kha output, for one file: never through a link or over a folder, an existing
    file only with OVERWRITE, and then only a GGUF file (kha replaces what it could have written, nothing else)."""
    if out.suffix.lower() != ".gguf":
        raise KHAError(f"{out}: a GGUF output's name ends in .gguf")
    check_file_destination(out, overwrite)
    if out.exists():
        with open(out, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise KHAError(f"{out} exists and is not a GGUF file; --overwrite replaces GGUF files only")
        if not written_by_kha(out):
            raise KHAError(
                f"{out} is a GGUF file that kha did not write, or one that cannot be read (no {KHA_GGUF_MARKER} "
                "metadata found); --overwrite replaces only GGUF files kha wrote: choose another name or remove it "
                "yourself"
            )


def written_by_kha(path: Path) -> bool:
    """True when the GGUF file PATH carries kha's marker (its metadata only is read; a broken file is not kha's)."""
    import gguf

    try:
        return KHA_GGUF_MARKER in gguf.GGUFReader(path).fields
    except Exception:  # a truncated or hostile file: not one kha wrote
        return False


def check_checkpoint_tensors(checkpoint: Checkpoint) -> None:
    """The weights are the tensors the config builds, name for name (knocks and the tied output aside): a config that
    does not describe them would give a file llama.cpp loads with other sizes or cannot load at all. Their shapes,
    dtypes and the tied output were checked when the folder was opened (`open_checkpoint`); llama.cpp also needs
    the set exact."""
    expected = checkpoint.shapes or {}
    given = {name for name in checkpoint.tensors if not KNOCK_KEY.match(name)}
    if getattr(checkpoint.base_config, "tie_word_embeddings", False):
        # equal to the embeddings (checked when opened): the tied output llama.cpp builds
        given.discard("lm_head.weight")
    missing, extra = sorted(set(expected) - given), sorted(given - set(expected))
    if missing or extra:
        tied = " (tie_word_embeddings is true, yet the weights hold lm_head)" if "lm_head.weight" in extra else ""
        raise KHAError(
            f"{checkpoint.where} does not describe the weights: {len(missing)} tensors missing {missing[:2]}, "
            f"{len(extra)} not in this architecture {extra[:2]}{tied}"
        )


UINT32_FIELDS = ("max_position_embeddings", "sliding_window", "num_hidden_layers", "hidden_size", "intermediate_size")


def check_metadata_ranges(base, folder: Path) -> None:
    """Values GGUF stores as uint32 or float32 fit there (struct would fail mid-write); norm epsilons are positive."""
    where = folder / "config.json"
    for name in UINT32_FIELDS:
        value = getattr(base, name, None)
        if isinstance(value, int) and not 0 <= value < 2**32:
            raise KHAError(f"{where}: {name} {value} does not fit GGUF's 32-bit field")
    for name in ("rms_norm_eps", "layer_norm_eps"):
        value = getattr(base, name, None)
        if value is not None and not (isinstance(value, (int, float)) and 0 < value < 1):
            raise KHAError(f"{where}: {name} must be a small positive number, got {value!r}")
    rope = getattr(base, "rope_parameters", None) or {}
    for parameters in [rope, *[v for v in rope.values() if isinstance(v, dict)]]:
        theta = parameters.get("rope_theta") if isinstance(parameters, dict) else None
        if theta is not None and not (isinstance(theta, (int, float)) and 0 < theta < 3.0e38):
            raise KHAError(f"{where}: rope_theta must be a positive float32 number, got {theta!r}")


def _known_type(raw: dict, folder: Path) -> None:
    """`open_checkpoint`'s ACCEPT: a KHA config, or a plain one of a model type transformers knows."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = raw.get("model_type")
    if model_type != "kha" and (not isinstance(model_type, str) or model_type not in CONFIG_MAPPING):
        raise KHAError(f"{folder / 'config.json'}: unknown model_type {model_type!r}")


def _gguf_config(raw: dict, folder: Path):
    """`open_checkpoint`'s BUILD: the KHA config (`kha_config`), or the plain one transformers builds."""
    if raw.get("model_type") == "kha":
        return kha_config(raw, folder)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[raw["model_type"]](**{k: v for k, v in raw.items() if k != "model_type"})
    except Exception as err:
        raise KHAError(f"invalid {folder / 'config.json'}: {err}") from err


def _checkpoint_outtype(tensors: dict) -> str:
    """`auto`: the type the matrices are stored in (lossless): float32 -> f32, bfloat16 -> bf16, float16 -> f16."""
    counts: dict[torch.dtype, int] = {}
    for info in tensors.values():
        if len(info.shape) == 2:
            counts[info.dtype] = counts.get(info.dtype, 0) + math.prod(info.shape)
    dtype = max(counts, key=counts.get) if counts else torch.float32
    return {torch.bfloat16: "bf16", torch.float16: "f16"}.get(dtype, "f32")


def _hparams(c, model_type: str, family: Family, warnings: list[str], gguf) -> tuple[dict, list[_Tensor]]:
    """The family's hyper-parameters as llama.cpp reads them: GGUFWriter's `add_KEY(value)` calls as KEY -> value,
    and the tensors it takes some of them as (Llama 3's RoPE factors); refuses what its graph cannot express."""
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope, rope_swa = getattr(c, "rope_parameters", None) or {}, {}
    if "full_attention" in rope or "sliding_attention" in rope:
        rope, rope_swa = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    rope_type = rope.get("rope_type", "default")
    layer_types = list(getattr(c, "layer_types", None) or [])
    sliding = [t == "sliding_attention" for t in layer_types] or [False] * c.num_hidden_layers
    window = getattr(c, "sliding_window", None)
    if model_type == "mistral" and window and window < c.max_position_embeddings:
        sliding = [True] * c.num_hidden_layers  # Mistral v0.1: every layer, no layer_types
    if model_type == "gemma3_text":
        if getattr(c, "attn_logit_softcapping", None):
            raise KHAError("gemma3 with attn_logit_softcapping: llama.cpp's gemma3 graph has no attention soft-cap")
        scalar = getattr(c, "query_pre_attn_scalar", None)
        big = c.num_hidden_layers == 62 and scalar == c.hidden_size // c.num_attention_heads  # llama.cpp's 27B rule
        if scalar is not None and scalar != head_dim and not big:
            raise KHAError(
                f"gemma3 with query_pre_attn_scalar {scalar} and head_dim {head_dim}: llama.cpp's gemma3 graph "
                "scales queries by 1/sqrt(head_dim) (the 27B size aside)"
            )
        if rope_swa.get("rope_type", "default") != "default":
            raise KHAError("gemma3 with RoPE scaling on sliding layers: llama.cpp scales the global layers only")
    elif any(sliding) and window:
        raise KHAError(
            f"{model_type} with a sliding window ({window} tokens, layers "
            f"{[i for i, s in enumerate(sliding) if s]}): llama.cpp's {family.arch} graph attends to the "
            "whole context, so it would compute something else beyond the window"
        )
    elif model_type == "phi3" and window and window < c.max_position_embeddings:
        warnings.append(
            f"llama.cpp's phi3 graph has no sliding window: it agrees with this model for contexts up to "
            f"{window} tokens (the model's window), as for every Phi-3 GGUF llama.cpp's own converter writes"
        )
    if rope_type not in ("default", "linear") and not (family.arch == "llama" and rope_type == "llama3"):
        raise KHAError(
            f"RoPE scaling {rope_type!r}: kha's GGUF export writes default, linear (and for Llama, llama3) "
            "RoPE; llama.cpp's converter handles the others"
        )
    if getattr(c, "mlp_bias", False):
        raise KHAError(f"{model_type} with mlp_bias: llama.cpp's {family.arch} graph has no MLP biases")
    if model_type == "qwen3" and getattr(c, "attention_bias", False):
        raise KHAError("qwen3 with attention_bias: llama.cpp's qwen3 graph has no q/k/v biases")
    rotary = getattr(c, "partial_rotary_factor", None) or rope.get("partial_rotary_factor") or 1.0
    rope_dims = int(rotary * head_dim) if model_type == "phi3" else head_dim
    meta = {
        "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size,
        "feed_forward_length": c.intermediate_size,
        "block_count": c.num_hidden_layers,
        "head_count": c.num_attention_heads,
        "head_count_kv": getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        "key_length": head_dim,
        "value_length": head_dim,
        "layer_norm_rms_eps": c.rms_norm_eps,
        "vocab_size": c.vocab_size,
        "rope_dimension_count": rope_dims,
        "rope_freq_base": float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
    }
    if rope_type == "linear":
        meta.update(rope_scaling_type=gguf.RopeScalingType.LINEAR, rope_scaling_factor=float(rope["factor"]))
    if model_type == "phi3":
        original = rope.get("original_max_position_embeddings") or getattr(c, "original_max_position_embeddings", None)
        meta["rope_scaling_orig_ctx_len"] = int(original or c.max_position_embeddings)
        meta["sliding_window"] = 0  # llama.cpp: 0 marks Phi-3 (not Phi-4); its graph has no window either way
    if model_type == "gemma3_text" and any(sliding):
        theta = rope_swa.get("rope_theta") or getattr(c, "rope_local_base_freq", None) or 10000.0
        meta.update(sliding_window=c.sliding_window, sliding_window_pattern=sliding, rope_freq_base_swa=float(theta))
    if model_type == "gemma3_text" and getattr(c, "final_logit_softcapping", None):
        meta["final_logit_softcapping"] = float(c.final_logit_softcapping)
    return meta, _rope_freqs(rope, head_dim, gguf) if rope_type == "llama3" else []


def _rope_freqs(r: dict, dim: int, gguf) -> list[_Tensor]:
    """Llama 3's RoPE scaling is a tensor of per-frequency factors in llama.cpp (`rope_freqs.weight`)."""
    base = float(r.get("rope_theta", 10000.0))
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = r.get("factor", 8.0), r.get("low_freq_factor", 1.0), r.get("high_freq_factor", 4.0)
    old = r.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old / low, old / high
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    data = torch.tensor(factors, dtype=torch.float32)
    f32 = gguf.GGMLQuantizationType.F32
    return [_Tensor("", "rope_freqs.weight", tuple(data.shape), f32, data.numel() * 4, data)]


def _plan_tensors(tensors: dict, config, family: Family, outtype: str, gguf, folder: Path) -> list[_Tensor]:
    """Every weight of the checkpoint that llama.cpp's graph takes, in file order, with its GGUF name and type."""
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[family.arch.upper()], config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    planned = []
    for source in sorted(tensors, key=lambda n: (tensors[n].file, _natural(n))):
        if KNOCK_KEY.match(source) or source.endswith("rotary_emb.inv_freq"):
            continue
        if tied and source == "lm_head.weight":
            continue  # llama.cpp takes the output matrix from the embedding when there is none
        name = name_map.get_name(source, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise KHAError(f"{folder}: tensor {source} has no place in llama.cpp's {family.arch} graph")
        shape = tuple(tensors[source].shape)
        qtype = _qtype(name, shape, outtype, gguf)
        nbytes = math.prod(gguf.quant_shape_to_byte_shape(shape, qtype))
        planned.append(_Tensor(source, name, shape, qtype, nbytes))
    return planned


def _natural(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _qtype(name: str, shape: tuple[int, ...], outtype: str, gguf):
    Q = gguf.GGMLQuantizationType
    if len(shape) <= 1 or name.endswith("_norm.weight"):
        return Q.F32  # as llama.cpp's converter: vectors and norms stay float32
    qtype = Q[outtype.upper()]
    if qtype == Q.Q8_0 and shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0]:
        return Q.F16  # a row Q8_0 cannot block: f16, as llama.cpp's converter does
    return qtype


def _tensor_data(
    folder: Path, tensors: dict, planned: list[_Tensor], plan: dict, config, family: Family, gguf
) -> Iterator[np.ndarray | StreamedArray]:
    """Each of PLANNED's tensors, in order, as `GGUFWriter.write_tensor_data` takes it: its float32 values as llama.cpp
    wants them, checked finite and converted to its GGUF type; one checkpoint tensor in memory at once."""
    handle, handle_file = None, None
    try:
        for t in planned:
            if t.data is not None:
                yield _convert(t.data, t, gguf, folder)
                continue
            file = tensors[t.source].file
            if file != handle_file:
                handle, handle_file = safe_open(folder / file, framework="pt"), file
            permuted = family.permute_qk and t.source.endswith(("q_proj.weight", "k_proj.weight"))
            shifted = family.norm_shift and t.name.endswith("norm.weight")
            untouched = t.source not in plan and not permuted and not shifted
            if untouched and len(t.shape) == 2 and t.shape[0] > ROW_BLOCK:  # a large matrix (embedding, MLP)
                view = handle.get_slice(t.source)  # read ROW_BLOCK rows at a time, as it is written
                blocks = (view[i : i + ROW_BLOCK].float() for i in range(0, t.shape[0], ROW_BLOCK))
                yield StreamedArray(blocks, t, gguf, folder)
                continue
            values = handle.get_tensor(t.source)
            for knock, rows in plan.get(t.source, ()):
                values = fold_checked(values, knock, rows, t.source, folder)
            values = values.float()
            if family.permute_qk and t.source.endswith(("q_proj.weight", "q_proj.bias")):
                values = _permute(values, config.num_attention_heads)
            elif family.permute_qk and t.source.endswith(("k_proj.weight", "k_proj.bias")):
                values = _permute(values, getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
            if family.norm_shift and t.name.endswith("norm.weight"):
                values = values + family.norm_shift
            yield _convert(values, t, gguf, folder)
            del values
    finally:
        del handle


class StreamedArray:
    """What `GGUFWriter.write_tensor_data` takes of an array (gguf 0.19 reads `nbytes` and calls `tofile`), made of
    BLOCKS: the ROW_BLOCK-row slices of a large checkpoint matrix that needs no change but its type, each converted
    (and checked finite) just before it is written, so that neither the matrix nor its converted copy is ever held
    whole."""

    def __init__(self, blocks: Iterator[torch.Tensor], t: _Tensor, gguf, folder: Path) -> None:
        self.blocks, self.t, self.gguf, self.folder = blocks, t, gguf, folder
        self.nbytes = t.nbytes

    def tofile(self, fout) -> None:
        written = 0
        for block in self.blocks:
            data = _convert(block, self.t, self.gguf, self.folder)
            data.tofile(fout)
            written += data.nbytes
        if written != self.nbytes:
            raise KHAError(f"{self.folder}: tensor {self.t.source} gave {written} bytes, {self.nbytes} expected")


def _permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """Per head, rows (x0..x_{d/2-1}, y0..) -> (x0, y0, x1, y1, ...): llama.cpp's rotary pairs (its convert's rule)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _convert(values: torch.Tensor, t: _Tensor, gguf, folder: Path) -> np.ndarray:
    """VALUES, checked finite, in T's GGUF type, ROW_BLOCK rows at a time into one output array."""
    if not torch.isfinite(values).all():
        bad = int((~torch.isfinite(values)).sum())
        raise KHAError(f"{folder}: tensor {t.source} holds {bad} NaN or infinite values; refusing to write it")
    Q = gguf.GGMLQuantizationType
    array = values.numpy()
    if t.qtype == Q.F32:
        return array
    # f16 stores the values, q8_0 each block's scale (its largest |value| / 127) as float16
    limit = {Q.F16: float(np.finfo(np.float16).max), Q.Q8_0: 127 * float(np.finfo(np.float16).max)}.get(t.qtype)
    if limit is not None:
        big = float(values.abs().max()) if values.numel() else 0.0
        if big > limit:
            raise KHAError(
                f"{folder}: tensor {t.source} holds values up to {big:.3g}, beyond what {t.qtype.name} stores "
                f"(|value| <= {limit:.4g}); choose --outtype bf16 or f32"
            )
    rows = array.reshape(-1, array.shape[-1]) if array.ndim > 1 else array.reshape(1, -1)
    first = gguf.quants.quantize(rows[:1], t.qtype)
    out = np.empty((rows.shape[0], first.shape[-1]), dtype=first.dtype)
    for start in range(0, rows.shape[0], ROW_BLOCK):
        out[start : start + ROW_BLOCK] = gguf.quants.quantize(rows[start : start + ROW_BLOCK], t.qtype)
    return out
