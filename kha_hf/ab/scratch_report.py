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
    if variants is None:
        print(f"{'seed':>6} {'baseline':>10} {'KHA':>10} {'Δ':>9}   (held-out loss)")
        for row in comparison["per_seed"]:
            print(
                f"{row['seed']:>6} {row['baseline_heldout']:>10.4f} {row['kha_heldout']:>10.4f} {row['delta']:>+9.4f}"
            )
        print_comparison(comparison)
    else:
        print(ablation_table(summary))
    arms = stability["arms"]
    spikes = ", ".join(f"{arm} {entry['spikes_mean']:.1f}" for arm, entry in arms.items())
    print(f"loss spikes per run (mean over seeds): {spikes}")
    written = ("loss_curves.csv", "stability.csv", "loss_curves.png", "summary.json")
    print("wrote " + ", ".join(str(final / name) for name in written))
    return summary


def ablation_table(summary: dict) -> str:
    """The paper's ablation layout from a variants summary: one row per variant."""
    stability = summary["stability"]["arms"]
    base = stability.get("baseline", {})
    seeds = len(summary["seeds"])
    lines = [
        f"{'variant':<16} {'Δ held-out loss [95 % CI], ' + str(seeds) + ' seeds':<38} {'spikes (base→var)':<18} "
        f"{'max grad norm':<14} paper Δ ({summary['paper_setting']})"
    ]
    for name, entry in summary["variants"].items():
        interval = entry["ci95"]
        ci = "[no interval]" if interval is None else f"[{interval[0]:+.4f}, {interval[1]:+.4f}]"
        arm = stability.get(name, {})
        spikes = f"{base.get('spikes_mean', 0):.1f} → {arm.get('spikes_mean', 0):.1f}"
        norm = arm.get("max_grad_norm_mean")
        paper = entry["paper_delta"]
        paper_text = "higher (no number)" if paper is None and name.endswith("_random") else _signed(paper)
        lines.append(
            f"{name:<16} {entry['delta_mean']:+.4f} {ci:<30} {spikes:<18} "
            f"{'-' if norm is None else f'{norm:.3g}':<14} {paper_text}"
        )
    return "\n".join(lines)


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
        arms.setdefault(run.arm, {"per_seed": []})["per_seed"].append({name: getattr(run, name) for name in numbers})
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
        shown = f"95 % CI [{interval[0]:+.4f}, {interval[1]:+.4f}] ({verdict})"
    print(
        f"Δ held-out ({comparison['arm']} − {comparison['control']}) over {comparison['n_seeds']} seed(s): "
        f"{comparison['delta_mean']:+.4f}, {shown}"
    )
