"""`kha fold`: absorb KHA-Linear knocks into the q/k/v projections, giving a plain base-family checkpoint.

A linear knock follows its projection directly (before q/k norm and RoPE), so per head h
`(W_h x + b_h) T = (Tᵀ W_h) x + Tᵀ b_h`. With the nn.Linear convention `knock.weight = Tᵀ`, hence
`W_h' = knock.weight @ W_h` and `b_h' = knock.weight @ b_h`, computed in float64 and cast back. W_h are the rows
of the projection that the family layout gives the knock's target in head h: a plain q/k/v_proj's head slices,
Phi-3's q, k and v blocks of qkv_proj, MLA's no-RoPE rows of q_b_proj and the k / v rows of kv_b_proj (so MLA's
latent projections absorb the knocks, and absorbed inference stays exact).
Shards without projections of knocked layers are copied byte for byte; memory is one shard plus the knocks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LMS
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as IMAGE_TEXT_TO_TEXT_LMS

from ..checkpoint.knock_reader import open_kha_checkpoint
from ..checkpoint.output import atomic_output_dir, carry_over_files, check_free_space, place_file, report_placement
from ..checkpoint.paths import check_destination, check_source_links
from ..checkpoint.safetensors_index import INDEX_FILE, shard_files
from ..common.errors import KHAError
from ..common.model_card import kha_card, read_source_card
from ..common.model_code import copy_model_code
from ..modeling.configuration_kha import TASK_HEADS, KHAConfig, control_refusal, family_heads, mlp_knocks_phrase
from ..modeling.knocks import finite_mask
from .fold_plan import checked_fold_plan, fold_checked

if TYPE_CHECKING:
    from .gguf_export import GGUFResult


@dataclass
class FoldResult:
    output: Path
    folded: list[str]  # knock tensors absorbed
    kept_kha: bool  # True for a partial fold (the output is still a KHA model with an MLP value knock)

    @property
    def summary(self) -> str:
        """What `kha fold` prints."""
        kind = "KHA checkpoint (value MLP kept)" if self.kept_kha else "plain checkpoint"
        return f"wrote {self.output}: {kind}, {len(self.folded)} knock tensors folded"


def fold(
    kha_dir: str | Path,
    out: str | Path,
    partial: bool = False,
    overwrite: bool = False,
    link: bool = False,
    progress: bool = True,
    outtype: str = "auto",
    tokenizer_pre: str | None = None,
) -> FoldResult | GGUFResult:
    """Fold every linear knock of KHA_DIR into its projection and write a stock checkpoint to OUT.

    An MLP value knock is non-linear and cannot be folded: refused, unless `partial=True` with linear Q/K knocks,
    which folds Q/K and writes a KHA checkpoint that keeps only the value MLP.
    An OUT ending in `.gguf` is one GGUF file for llama.cpp (`gguf_export.export_gguf`: OUTTYPE, TOKENIZER_PRE).

    Args:
        kha_dir: a KHA checkpoint folder with linear knocks (`linear_v`, `linear_qkv`, or `mlp_v_linear_qk` with
            `partial`).
        out: the output folder, or a `.gguf` file; it appears only when complete.
        partial: fold the linear Q/K knocks of `mlp_v_linear_qk` and keep the value MLP (default False).
        overwrite: replace an existing OUT, only one kha wrote (default False).
        link: hard-link the shards that need no change instead of copying them (default False).
        progress: show progress bars (default True).
        outtype: the GGUF tensor type: `auto` (as stored, default), `f32`, `f16`, `bf16`, `q8_0`; GGUF only.
        tokenizer_pre: llama.cpp's pre-tokenizer name, when it cannot be told from the tokenizer; GGUF only.

    Returns:
        A `FoldResult`: `output` (the written path), `folded` (the knock tensors absorbed) and `kept_kha` (True for
        a partial fold, whose output is still a KHA checkpoint); for a `.gguf` OUT, `gguf_export.GGUFResult`.

    Raises:
        KHAError: in one line, before anything is written: MLP knocks without `partial`, knocks that are
            non-finite, missing or misshapen, a fold whose values do not fit the dtype, an OUT that exists (without
            `overwrite`) or lies inside KHA_DIR, and for GGUF a family llama.cpp's graph would compute differently.
    """
    if str(out).lower().endswith(".gguf"):
        from .gguf_export import export_gguf

        return export_gguf(kha_dir, out, outtype, overwrite, tokenizer_pre, progress, partial=partial, link=link)
    if outtype != "auto" or tokenizer_pre:
        raise KHAError("--outtype and --tokenizer-pre apply to a GGUF output only (an OUT ending in .gguf)")
    kha_dir = Path(kha_dir)
    out = check_destination(out, [kha_dir], overwrite)
    check_source_links(kha_dir)  # no link out of KHA_DIR: nothing from elsewhere is copied into OUT
    kha = open_kha_checkpoint(kha_dir)  # read and checked: config, weights, head, knocks
    config, tensors = kha.config, kha.tensors
    if config.control_knocks:
        raise KHAError(control_refusal(f"{kha_dir}: {config.control_knocks}", "kha fold"))
    linear = [t for t in ("q", "k", "v") if getattr(config, f"knock_{t}") == "linear"]
    mlps = config.nonlinear_targets
    names = "/".join(t.upper() for t in mlps)  # the knocks a partial fold keeps
    if partial and not mlps:  # it would write a KHA checkpoint without knocks
        raise KHAError("--partial keeps an MLP knock, and this model has none: fold it without --partial")
    if mlps:
        if not partial:
            raise KHAError(
                f"{mlp_knocks_phrase(mlps)} (KHA-MLP), which is non-linear and cannot be folded into "
                f"{'/'.join(f'{t}_proj' for t in mlps)}; "
                + (
                    f"use --partial to fold the linear {'/'.join(t.upper() for t in linear)} knocks and keep a KHA "
                    f"model with the {names} MLP"
                    if linear
                    else "serve this model with transformers and trust_remote_code instead"
                )
            )
        if not linear:
            raise KHAError(f"nothing to fold: this model has no linear knocks (only the {names} MLP)")
    lm = "KHAForConditionalGeneration" if config.is_multimodal else "KHAForCausalLM"
    kind = next((name for name in config.architectures or () if name in TASK_HEADS), lm)
    heads = family_heads(config.base_model_type)  # a reward model or classifier keeps its head class
    if kind != lm and kind not in heads:
        raise KHAError(f"{kha_dir}: {config.base_model_type} has no {kind.removeprefix('KHAFor')} head in transformers")
    needed = sum((kha_dir / f).stat().st_size for f in shard_files(tensors))
    check_free_space(out.parent, needed, "the folded shards")  # where the temporary folder will be, beside OUT
    plan, folded_knocks = checked_fold_plan(kha, linear)
    dropped = set(folded_knocks)

    with atomic_output_dir(out, overwrite=overwrite, marker="fold") as tmp:
        weight_map, placed = {}, []
        for file in tqdm(shard_files(tensors), desc="fold shards", unit="shard", disable=not progress):
            in_file = [n for n, info in tensors.items() if info.file == file]
            kept = [n for n in in_file if n not in dropped]
            if not kept:
                continue  # a file of knocks only
            if len(kept) < len(in_file) or any(n in plan for n in in_file):  # knocks to drop or to fold in
                with safe_open(kha_dir / file, framework="pt") as f:
                    metadata = f.metadata() or {"format": "pt"}
                    new = {}
                    for name in kept:
                        tensor = f.get_tensor(name)
                        if name in plan and not finite_mask(tensor).all():  # NaN * knock is NaN: no overflow seen
                            bad = int((~finite_mask(tensor)).sum())
                            raise KHAError(f"{kha_dir}: {name} holds {bad} NaN or infinite values; refusing to fold it")
                        for knock, rows in plan.get(name, ()):
                            tensor = fold_checked(tensor, knock, rows, name, kha_dir)
                        new[name] = tensor
                save_file(new, tmp / file, metadata=metadata)
            else:
                placed.append(place_file(kha_dir / file, tmp / file, link))
            weight_map.update(dict.fromkeys(kept, file))
        report_placement(placed)
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        carry_over_files(kha_dir, tmp)
        if partial:
            written = card_config = KHAConfig(**{**config.to_dict(), **{f"knock_{t}": "none" for t in linear}})
            written.architectures = [kind]
            copy_model_code(tmp)
            what = f"a KHA checkpoint whose {names} MLP remains"
        else:
            written, card_config = config.to_base_config(), config
            lms = IMAGE_TEXT_TO_TEXT_LMS if config.is_multimodal else CAUSAL_LMS
            written.architectures = [heads.get(kind) or lms[config.base_model_type]]
            written.dtype = config.dtype
            what = f"a plain `{config.base_model_type}` checkpoint"
        written.to_json_file(tmp / "config.json")
        source = read_source_card(kha_dir)
        source.body = ""  # the KHA card describes knocks that are gone; keep its Hub metadata only
        description = (
            f"The linear knocks ({', '.join(t.upper() for t in linear)}) of a Knocking-Heads Attention model built on "
            f"{{base}} were absorbed into the q/k/v projections by `kha fold`, giving {what}: it computes what the "
            "KHA model computed, at no extra cost."
        )
        (tmp / "README.md").write_text(kha_card(card_config, source, "KHA-Linear model, folded", description))
    return FoldResult(out, folded_knocks, partial)
