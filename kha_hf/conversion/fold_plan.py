"""Where each linear knock folds: the projection rows it multiplies, and the fold itself with a one-line overflow error.

Shared by `kha fold` into a folder (`fold.py`) and into a GGUF file (`gguf_export.py`): the rule is
`W_h' = knock.weight @ W_h` (and the same for a bias) over the rows the family layout gives the knock's target in
head h, computed in float64 by `modeling.knocks.fold_projection`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint.knock_reader import KHACheckpoint
from ..checkpoint.knock_tensors import KNOCK_KEY, knock_key, projection_key
from ..common.errors import KHAError
from ..modeling.configuration_kha import KHAConfig
from ..modeling.families import family_spec, segment_rows
from ..modeling.knocks import fold_projection


def fold_plan(
    config: KHAConfig, tensors: dict, prefix: str, knocks: dict[str, torch.Tensor], linear: list[str]
) -> dict[str, list[tuple[torch.Tensor, list[tuple[int, int]]]]]:
    """Projection tensor name -> [(knock matrix, rows it applies to), ...] for the LINEAR knock targets (of the
    text decoder, in a multimodal model)."""
    config = config.knock_config
    layout = family_spec(config.base_model_type).layout
    plan: dict[str, list[tuple[torch.Tensor, list[tuple[int, int]]]]] = {}
    for layer in config.knocked_layers:
        for projection, blocks in layout.items():
            for target in linear:
                rows = segment_rows(config, blocks, target)
                if not rows:
                    continue
                knock = knocks[knock_key(prefix, layer, target, "weight")]
                for part in ("weight", "bias"):
                    name = projection_key(prefix, layer, projection, part)
                    if name in tensors:
                        plan.setdefault(name, []).append((knock, rows))
    return plan


def fold_checked(
    tensor: torch.Tensor, knock: torch.Tensor, rows: list[tuple[int, int]], name: str, kha_dir: Path
) -> torch.Tensor:
    """`fold_projection` of tensor NAME, with a one-line error where the folded values overflow its dtype."""
    try:
        return fold_projection(tensor, knock, rows)
    except OverflowError as err:
        raise KHAError(
            f"{kha_dir}: folding the knocks into {name}: {err}; fold a float32 copy of the model instead "
            "(KHAForCausalLM.from_pretrained(..., dtype=torch.float32).save_pretrained(...))"
        ) from None


def checked_fold_plan(
    kha: KHACheckpoint, linear: list[str]
) -> tuple[dict[str, list[tuple[torch.Tensor, list[tuple[int, int]]]]], list[str]]:
    """(`fold_plan` of KHA's LINEAR knocks, the knock tensors it absorbs); the knocks were checked when KHA was
    opened (names, shapes), their values are checked as they are read (finite)."""
    plan = fold_plan(kha.config, kha.tensors, kha.prefix, kha.read_knocks(), linear)
    return plan, [k for k in kha.knock_names if KNOCK_KEY.match(k).group("target") in linear]
