"""The report of a from-scratch A/B (`kha ab`): summary.json, the CSVs and the plot, and the printed table: one twin
against the baseline, or the paper's ablation layout (variant, Δ held-out loss [95 % CI over seeds], spikes, the
paper's Δ).

Arms that share a seed share their initial weights (up to the knocks) and data order, so their difference is a
paired sample; the spread of those differences over seeds gives the 95 % t-interval (`statistics.seed_interval`).
"""

from __future__ import annotations

from pathlib import Path

from ..common.statistics import seed_interval
from ..training.spikes import SPIKE_MARGIN
from .arm import ArmRun
from .report import plot_mean_curves, write_curves_csv, write_json
from .stability import stability_summary, write_stability_csv
from .variants import PAPER_SETTING, Variant


def write_report(
    runs: list[ArmRun],
    output: Path,
    knock: str,
    config,
    steps: int,
    final: Path | None = None,
    variants: list[Variant] | None = None,
    spike_margin: float = SPIKE_MARGIN,
) -> dict:
    """Write the CSVs, JSON and PNG into OUTPUT and print the comparison; FINAL: where OUTPUT will be moved.

    Without VARIANTS: the twin is the arm "kha" (summary keys `delta_mean`, `ci95`, ... as ever). With VARIANTS:
    `summary["variants"][name]` holds each variant's paired comparison with the baseline and the paper's Δ."""
    final = final or output
    stability = stability_summary(runs, "baseline", spike_margin)
    summary = {
        "knock": knock,
        "base_model_type": config.model_type,
        "steps": steps,
        "seeds": sorted({r.seed for r in runs}),
    }
    if variants is None:
        comparison = compare_arms(runs, "kha", "baseline")
        summary.update({key: comparison[key] for key in ("delta_mean", "ci95", "excludes_zero", "per_seed")})
    else:
        summary["paper_setting"] = PAPER_SETTING
        summary["variants"] = {
            v.name: {
                "knock": v.knock,
                "knock_init": v.knock_init,
                **compare_arms(runs, v.name, "baseline"),
                "paper_delta": v.paper_delta,
            }
            for v in variants
        }
    summary["arms"] = arm_summary(runs)
    summary["stability"] = stability
    write_curves_csv(runs, output / "loss_curves.csv")
    write_stability_csv(runs, output / "stability.csv")
    write_json(output / "summary.json", summary)
    title = f"from-scratch A/B: baseline vs KHA ({knock})" if variants is None else "from-scratch ablation"
    plot_mean_curves(runs, output / "loss_curves.png", title, stability)
    names = ["kha"] if variants is None else [v.name for v in variants]
    print(per_seed_table(runs, ["baseline", *names]))
    print(comparison_table(summary, names if variants is not None else None, comparison if variants is None else None))
    if variants is None:
        print_comparison(comparison)
    arms = stability["arms"]
    spikes = ", ".join(f"{arm} {entry['spikes_mean']:.1f}" for arm, entry in arms.items())
    print(f"loss spikes per run (mean over seeds): {spikes}")
    written = ("loss_curves.csv", "stability.csv", "loss_curves.png", "summary.json")
    print("wrote " + ", ".join(str(final / name) for name in written))
    return summary


def per_seed_table(runs: list[ArmRun], arms: list[str]) -> str:
    """Each seed's held-out loss for every arm: the values the intervals below are computed from."""
    by_run = {(r.arm, r.seed): r.heldout_loss for r in runs}
    width = max(10, *(len(arm) for arm in arms))
    lines = ["held-out loss per seed", f"{'seed':>6} " + " ".join(f"{arm:>{width}}" for arm in arms)]
    for seed in sorted({r.seed for r in runs}):
        cells = (by_run.get((arm, seed)) for arm in arms)
        lines.append(f"{seed:>6} " + " ".join(f"{'-' if v is None else f'{v:.4f}':>{width}}" for v in cells))
    return "\n".join(lines)


def comparison_table(summary: dict, variants: list[str] | None = None, single: dict | None = None) -> str:
    """The comparison with the baseline, one row an arm: its mean held-out loss, Δ = arm − baseline (negative: the
    arm's loss is lower) with its 95 % t-interval and degrees of freedom, spikes and the largest gradient norm as
    baseline → arm (means over seeds), and with VARIANTS the paper's Δ. SINGLE: the one twin's comparison
    (`compare_arms`) when there are no variants."""
    stability = summary["stability"]["arms"]
    base = stability.get("baseline", {})
    arms = summary["arms"]
    entries = {"kha": single} if variants is None else summary["variants"]
    paper = f"  paper Δ ({summary['paper_setting']})" if variants is not None else ""
    lines = [
        f"held-out loss, mean over {len(summary['seeds'])} seed(s); Δ = arm − baseline (negative: lower loss than "
        "the baseline)",
        f"{'arm':<16} {'loss':>8} {'Δ':>8}  {'95 % CI (t)':<28} {'spikes':<12} {'max grad norm':<16}{paper}".rstrip(),
        f"{'baseline':<16} {arms['baseline']['heldout_loss_mean']:>8.4f}",
    ]
    for name, entry in entries.items():
        arm = stability.get(name, {})
        spikes = f"{base.get('spikes_mean', 0):.1f} → {arm.get('spikes_mean', 0):.1f}"
        norms = f"{_short(base.get('max_grad_norm_mean'))} → {_short(arm.get('max_grad_norm_mean'))}"
        row = (
            f"{name:<16} {arms[name]['heldout_loss_mean']:>8.4f} {entry['delta_mean']:>+8.4f}  "
            f"{_interval(entry):<28} {spikes:<12} {norms:<16}"
        )
        if variants is not None:
            value = entry["paper_delta"]
            row += "  " + ("higher (no number)" if value is None and name.endswith("_random") else _signed(value))
        lines.append(row.rstrip())
    return "\n".join(lines)


def _interval(entry: dict) -> str:
    """'[-0.0400, -0.0042] df 2' or why there is none."""
    df = entry["n_seeds"] - 1
    if entry["ci95"] is None:
        return "none: one seed" if df < 1 else "none: no spread"
    low, high = entry["ci95"]
    return f"[{low:+.4f}, {high:+.4f}] df {df}"


def _short(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.3f}"


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
    # a from-scratch run measures neither its untrained loss (heldout_before stays null) nor its trainable parameters
    arms: dict[str, dict] = {}
    for run in runs:
        numbers = ("seed", "train_loss", "heldout_loss", "heldout_before")
        entry = {name: getattr(run, name) for name in numbers}
        if run.validation_curve is not None:  # --eval-steps: (step, validation loss) while training
            entry["validation_curve"] = [list(point) for point in run.validation_curve]
        arms.setdefault(run.arm, {"per_seed": []})["per_seed"].append(entry)
    for entry in arms.values():
        losses = [p["heldout_loss"] for p in entry["per_seed"]]
        entry["heldout_loss_mean"] = sum(losses) / len(losses)
    return arms


def print_comparison(comparison: dict) -> None:
    interval = comparison["ci95"]
    if interval is None:
        shown = "no interval (" + ("one seed; use --seeds 3 or more)" if comparison["n_seeds"] < 2 else "no spread)")
    else:
        verdict = "excludes 0" if comparison["excludes_zero"] else "includes 0: no significant difference"
        df = comparison["n_seeds"] - 1
        freedom = f"t, {df} degree{'s' * (df != 1)} of freedom"
        shown = f"95 % CI [{interval[0]:+.4f}, {interval[1]:+.4f}] ({freedom}; {verdict})"
    print(
        f"Δ held-out ({comparison['arm']} − {comparison['control']}) over {comparison['n_seeds']} seed(s): "
        f"{comparison['delta_mean']:+.4f}, {shown}"
    )
