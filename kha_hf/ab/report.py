"""What both modes of `kha ab` write of their runs: the loss curves as CSV and as a plot, and strict JSON."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from .arm import ArmRun


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
    (`stability.stability_summary`), each loss spike of each run marked (x) at its step and loss."""
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


def write_json(path: Path, data: dict) -> None:
    path.write_text(strict_json(data, indent=2) + "\n")


def strict_json(data, **options) -> str:
    """DATA as strict JSON: a NaN or infinite loss (a diverged run) is written as null, which every parser reads."""
    return json.dumps(_strict(data), allow_nan=False, **options)


def _strict(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(item) for item in value]
    return value
