"""What `kha ab` takes, light enough for `kha ab --help` (no torch): the arms and grids of continued training, the
argparse types of its lists, and which options belong to which mode (`MODE_OPTIONS`), with the one check that
refuses an option of one mode given in the other."""

from __future__ import annotations

import argparse

from ..common.errors import KHAError
from ..training.spikes import SPIKE_MARGIN

ARMS = ("base-full", "kha-full", "kha-knocks", "lora-matched", "knock-adapter", "ia3", "oft")
DEFAULT_ARMS = ARMS[:4]
ADAPTER_ARMS = ("knock-adapter", "lora-matched", "ia3", "oft")
LR_GRID_FULL = (2e-5, 5e-5, 1.5e-4)
LR_GRID_SMALL = (1e-3, 3e-3, 1e-2)
GRID_EXTENSIONS = 2
EVAL_LIMIT = 100

SCRATCH, CONTINUED = "scratch", "continued"
# option -> (its mode, its value when not given[, its own refusal in the other mode]); an option given in the other
# mode is refused, never ignored: those without a refusal of their own are named together in one line (`ONLY`)
MODE_OPTIONS = {
    "--variants": (SCRATCH, None),
    "--logit-every": (SCRATCH, None),
    "--spike-margin": (SCRATCH, SPIKE_MARGIN),
    "--save-models": (SCRATCH, False),
    "--bf16": (SCRATCH, False, "--bf16 is not used with --from (continued training runs in float32)"),
    "--lr": (
        SCRATCH,
        None,
        "with --from, set the knocks' and the LoRA's learning rates with --lr-grid (one value: fixed)",
    ),
    "--max-eval-blocks": (SCRATCH, None),
    "--eval-steps": (SCRATCH, None),
    "--lr-scheduler": (SCRATCH, "cosine"),
    "--warmup-steps": (SCRATCH, None),
    "--warmup-ratio": (SCRATCH, None),
    "--min-lr-ratio": (SCRATCH, None),
    "--decay-ratio": (SCRATCH, None),
    "--peak-flops": (SCRATCH, None),
    "--arms": (CONTINUED, list(DEFAULT_ARMS)),
    "--lr-grid": (CONTINUED, list(LR_GRID_SMALL)),
    "--lr-grid-full": (CONTINUED, list(LR_GRID_FULL)),
    "--grid-extensions": (CONTINUED, GRID_EXTENSIONS),
    "--eval": (CONTINUED, False),
    "--limit": (CONTINUED, EVAL_LIMIT),
    "--tokenizer": (CONTINUED, None),
    "--trust-remote-code": (CONTINUED, False),
    "--run-cache": (CONTINUED, None),
}
ONLY = {SCRATCH: "to from-scratch runs only, not --from", CONTINUED: "only with --from MODEL"}


def check_mode(args) -> None:
    """Refuse every option of MODE_OPTIONS that ARGS gives (a value other than its default) outside its mode."""
    mode = CONTINUED if args.from_model else SCRATCH
    given = [
        option
        for option, (owner, default, *_) in MODE_OPTIONS.items()
        if owner != mode and getattr(args, option[2:].replace("-", "_")) != default
    ]
    named = [option for option in given if len(MODE_OPTIONS[option]) == 2]
    if named:
        other = SCRATCH if mode == CONTINUED else CONTINUED
        raise KHAError(f"{', '.join(named)} {'applies' if len(named) == 1 else 'apply'} {ONLY[other]}")
    if given:
        raise KHAError(MODE_OPTIONS[given[0]][2])


def arm_list(text) -> list[str]:
    """argparse type: comma-separated arm names, or 'adapters' (ADAPTER_ARMS)."""
    if isinstance(text, (list, tuple)):
        return list(text)
    names = [part.strip() for part in str(text).split(",") if part.strip()]
    if names == ["adapters"]:
        return list(ADAPTER_ARMS)
    if "adapters" in names:
        raise argparse.ArgumentTypeError(f"{text!r}: 'adapters' stands alone (it means {','.join(ADAPTER_ARMS)})")
    unknown = [name for name in names if name not in ARMS]
    if not names or unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give distinct arms from {', '.join(ARMS)}, or 'adapters'"
            + (f" ({', '.join(unknown)} unknown)" if unknown else "")
        )
    return names


def variant_list(text) -> list[str]:
    """argparse type: comma-separated ablation variants (knock presets, each optionally `_random`)."""
    from .variants import parse_variants

    try:
        return [v.name for v in parse_variants(text)]
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
