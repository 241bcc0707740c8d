"""The stability part of a from-scratch A/B report: spike counts, largest gradient norms and attention logits per
arm and seed, their paired differences against the baseline over seeds, and the per-step CSV."""

from __future__ import annotations

import csv
import math
from pathlib import Path

from ..common.statistics import seed_interval
from ..training.spikes import SPIKE_MARGIN, SPIKE_WINDOW, spike_steps
from ..training.stability import stability_metrics
from .arm import ArmRun


def run_stability(run: ArmRun, margin: float = SPIKE_MARGIN) -> dict:
    """One run's numbers: spikes (count and steps), the largest global and knock gradient norms, the largest logit
    (those of `kha train`'s train_results.json: `training.stability.stability_metrics`)."""
    rows = run.stability or []
    losses = [math.nan if row.get("loss") is None else row["loss"] for row in rows]  # null: a NaN kept as JSON
    metrics = stability_metrics(rows, margin)
    return {
        "seed": run.seed,
        "spikes": metrics["loss_spikes"],
        "spike_steps": [rows[i]["step"] for i in spike_steps(losses, margin=margin)],
        **{key: metrics[key] for key in ("max_grad_norm", "max_knock_grad_norm", "max_attention_logit")},
    }


def stability_summary(runs: list[ArmRun], control: str = "baseline", margin: float = SPIKE_MARGIN) -> dict:
    """arm -> per-seed stability numbers, their means, and (arms other than CONTROL) the paired differences in spike
    count and largest gradient norm against CONTROL, with 95 % t-intervals over seeds."""
    per_run = {(r.arm, r.seed): run_stability(r, margin) for r in runs if r.stability}
    arms: dict[str, dict] = {}
    for (arm, _seed), numbers in per_run.items():
        arms.setdefault(arm, {"per_seed": []})["per_seed"].append(numbers)
    for arm, entry in arms.items():
        seeds = entry["per_seed"]
        entry["spikes_mean"] = sum(s["spikes"] for s in seeds) / len(seeds)
        norms = [s["max_grad_norm"] for s in seeds if s["max_grad_norm"] is not None]
        entry["max_grad_norm_mean"] = sum(norms) / len(norms) if norms else None
        if arm == control:
            continue
        paired = [(s, per_run.get((control, s["seed"]))) for s in seeds]
        paired = [(s, c) for s, c in paired if c is not None]
        entry["spikes_delta"] = seed_interval([s["spikes"] - c["spikes"] for s, c in paired]) if paired else None
        norm_pairs = [(s, c) for s, c in paired if s["max_grad_norm"] is not None and c["max_grad_norm"] is not None]
        entry["max_grad_norm_delta"] = (
            seed_interval([s["max_grad_norm"] - c["max_grad_norm"] for s, c in norm_pairs]) if norm_pairs else None
        )
    return {
        "spike_definition": (
            f"a step whose training loss exceeds (1 + {margin:g}) x the median of the previous {SPIKE_WINDOW} steps' "
            "losses (judged from step 11 on; a non-finite loss counts); consecutive spike steps are one spike"
        ),
        "spike_margin": margin,
        "arms": arms,
    }


def write_stability_csv(runs: list[ArmRun], path: Path) -> None:
    """One row per (arm, seed, step): loss, gradient norms, learning rate, and the largest logit of each layer where
    that step measured them."""
    layers = max((len(row.get("max_logit") or []) for r in runs for row in r.stability or []), default=0)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            ["arm", "seed", "step", "loss", "grad_norm", "knock_grad_norm", "lr"]
            + [f"max_logit_layer{i}" for i in range(layers)]
        )
        for run in runs:
            for row in run.stability or []:
                logits = row.get("max_logit") or []
                writer.writerow(
                    [run.arm, run.seed, row["step"]]
                    + [_cell(row.get(k)) for k in ("loss", "grad_norm", "knock_grad_norm", "lr")]
                    + [_cell(v) for v in logits]
                    + [""] * (layers - len(logits))
                )


def _cell(value) -> str:
    return "" if value is None else f"{value:.6g}"
