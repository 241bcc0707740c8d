"""Reports of A/B runs repeated over seeds: CSV of loss curves, summary JSON with paired differences, a PNG.

Arms that share a seed share their initial weights (up to the knocks) and data order, so their difference is a
paired sample; the spread of those differences over seeds gives the 95 % t-interval (`statistics.seed_interval`).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..common.statistics import seed_interval


@dataclass
class ArmRun:
    arm: str  # "baseline", "kha", "kha-knocks", "lora", ...
    seed: int
    curve: list[tuple[int, float]]  # (step, training loss)
    train_loss: float  # last logged training loss
    heldout_loss: float
    heldout_before: float | None = None
    trainable_parameters: int | None = None
    wall_seconds: float | None = None
    lr: float | None = None
    validation_loss: float | None = None
    heldout_blocks: list[float] | None = None  # per-block held-out losses (continued A/B)
    other_blocks: list[float] | None = None  # per-block losses on the other-domain text
    flops: float | None = None  # estimated training FLOPs
    stability: list[dict] | None = None  # per optimizer step: loss, gradient norms, lr, logits (training/stability)
    model: object = field(default=None, repr=False)  # kept only when the run is evaluated afterwards


def compare_arms(runs: list[ArmRun], arm: str, control: str) -> dict:
    """Held-out loss of ARM minus CONTROL, per seed, and their mean with a 95 % t-interval over seeds."""
    by_seed = {(r.arm, r.seed): r for r in runs}
    seeds = sorted(r.seed for r in runs if r.arm == arm and (control, r.seed) in by_seed)
    per_seed = [
        {
            "seed": s,
            f"{control}_heldout": by_seed[(control, s)].heldout_loss,
            f"{arm}_heldout": by_seed[(arm, s)].heldout_loss,
            "delta": by_seed[(arm, s)].heldout_loss - by_seed[(control, s)].heldout_loss,
        }
        for s in seeds
    ]
    return {"arm": arm, "control": control, **seed_interval([p["delta"] for p in per_seed]), "per_seed": per_seed}


def arm_summary(runs: list[ArmRun]) -> dict:
    arms: dict[str, dict] = {}
    for run in runs:
        entry = arms.setdefault(run.arm, {"per_seed": []})
        entry["per_seed"].append(
            {
                "seed": run.seed,
                "train_loss": run.train_loss,
                "heldout_loss": run.heldout_loss,
                "heldout_before": run.heldout_before,
            }
        )
        if run.trainable_parameters is not None:
            entry["trainable_parameters"] = run.trainable_parameters
    for entry in arms.values():
        losses = [p["heldout_loss"] for p in entry["per_seed"]]
        entry["heldout_loss_mean"] = sum(losses) / len(losses)
        before = [p["heldout_before"] for p in entry["per_seed"] if p["heldout_before"] is not None]
        if before:
            entry["heldout_before_mean"] = sum(before) / len(before)
    return arms


def write_curves_csv(runs: list[ArmRun], path: Path) -> None:
    """One row per (seed, step), one loss column per arm."""
    arms = list(dict.fromkeys(r.arm for r in runs))
    table: dict[tuple[int, int], dict[str, float]] = {}
    for run in runs:
        for step, loss in run.curve:
            table.setdefault((run.seed, step), {})[run.arm] = loss
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["seed", "step", *(f"{arm}_loss" for arm in arms)])
        for (seed, step), losses in sorted(table.items()):
            writer.writerow([seed, step, *(f"{losses[a]:.5f}" if a in losses else "" for a in arms)])


def plot_mean_curves(runs: list[ArmRun], path: Path, title: str, stability: dict | None = None) -> None:
    """Mean training loss per arm over seeds, with the band between the lowest and highest seed; with STABILITY
    (`ab_stability.stability_summary`), each loss spike of each run marked (x) at its step and loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    colors = ["tab:gray", "tab:red", "tab:blue", "tab:green", "tab:orange", "tab:purple"]
    for color, arm in zip(colors, dict.fromkeys(r.arm for r in runs), strict=False):
        arm_runs = [r for r in runs if r.arm == arm]
        steps = [s for s, _ in arm_runs[0].curve]
        losses = np.array([[loss for _, loss in r.curve] for r in arm_runs if len(r.curve) == len(steps)])
        mean = losses.mean(axis=0)
        held = np.mean([r.heldout_loss for r in arm_runs])
        ax.plot(steps, mean, color=color, label=f"{arm} (held-out {held:.3f}, {len(losses)} seeds)")
        if len(losses) > 1:
            ax.fill_between(steps, losses.min(axis=0), losses.max(axis=0), color=color, alpha=0.2, linewidth=0)
        marks = _spike_marks(arm_runs, (stability or {}).get("arms", {}).get(arm, {}))
        if marks:
            ax.scatter(*zip(*marks, strict=True), marker="x", color=color, zorder=3, label=f"{arm}: loss spikes")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over seeds; band: min-max)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _spike_marks(runs: list[ArmRun], arm_stability: dict) -> list[tuple[int, float]]:
    """(step, loss) of every spike step of RUNS, from their per-step records."""
    marks = []
    for entry in arm_stability.get("per_seed", []):
        run = next((r for r in runs if r.seed == entry["seed"]), None)
        losses = {row["step"]: row["loss"] for row in (run.stability or [])} if run is not None else {}
        marks += [(step, losses[step]) for step in entry.get("spike_steps", []) if step in losses]
    return marks


def print_comparison(comparison: dict) -> None:
    interval = comparison["ci95"]
    if interval is None:
        shown = "no interval (" + ("one seed; use --seeds 3 or more)" if comparison["n_seeds"] < 2 else "no spread)")
    else:
        verdict = "excludes 0" if comparison["excludes_zero"] else "includes 0: no significant difference"
        shown = f"95 % CI [{interval[0]:+.4f}, {interval[1]:+.4f}] ({verdict})"
    print(
        f"Δ held-out ({comparison['arm']} − {comparison['control']}) over {comparison['n_seeds']} seed(s): "
        f"{comparison['delta_mean']:+.4f}, {shown}"
    )


def write_json(path: Path, data: dict) -> None:
    """DATA as strict JSON: a NaN or infinite loss (a diverged run) is written as null, which every parser reads."""
    path.write_text(json.dumps(_strict(data), indent=2, allow_nan=False) + "\n")


def _strict(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(item) for item in value]
    return value
