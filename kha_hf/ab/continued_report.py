"""What continued training (`kha ab --from`) reports: each arm's numbers, the paired comparisons on the held-out and
the other-domain blocks, the printed table, and the quick lm-eval suite on the first seed's models."""

from __future__ import annotations

from pathlib import Path

from ..common.statistics import seed_interval, two_level_bootstrap
from .arm import ArmRun
from .report import write_json

MERGEABLE = ("lora-matched", "ia3", "oft")  # evaluated merged; the MLP knock adapter cannot merge (it runs as is)
COMPARISONS = (
    ("kha-full", "base-full"),
    ("kha-knocks", "lora-matched"),
    ("knock-adapter", "lora-matched"),
    ("knock-adapter", "ia3"),
    ("knock-adapter", "oft"),
)


def _mean(values) -> float:
    return sum(values) / len(values)


def comparisons(arms) -> list[tuple[str, str]]:
    return [(arm, control) for arm, control in COMPARISONS if arm in arms and control in arms]


def arm_table(runs: list[ArmRun], before: dict, chosen_arms) -> dict:
    arms = {}
    for arm in chosen_arms:
        mine = [r for r in runs if r.arm == arm]
        forgetting = [[a - b for a, b in zip(r.other_blocks, before[arm]["other"], strict=True)] for r in mine]
        arms[arm] = {
            "lr": mine[0].lr,
            "trainable_parameters": mine[0].trainable_parameters,
            "training_flops_estimate": mine[0].flops,
            "wall_seconds": [r.wall_seconds for r in mine],
            "heldout_before": _mean(before[arm]["heldout"]),
            "heldout_after_mean": _mean([r.heldout_loss for r in mine]),
            "other_domain_before": _mean(before[arm]["other"]),
            "other_domain_after_mean": _mean([_mean(r.other_blocks) for r in mine]),
            "forgetting": two_level_bootstrap(forgetting),  # other-domain loss after − before, per seed and block
            "per_seed": [
                {
                    "seed": r.seed,
                    "heldout": r.heldout_loss,
                    "other_domain": _mean(r.other_blocks),
                    "validation": r.validation_loss,
                }
                for r in mine
            ],
        }
    return arms


def compare(runs: list[ArmRun], arm: str, control: str) -> dict:
    """ARM − CONTROL on the held-out and the other-domain blocks, paired per seed and block."""
    by = {(r.arm, r.seed): r for r in runs}
    seeds = sorted(r.seed for r in runs if r.arm == arm and (control, r.seed) in by)
    result = {"arm": arm, "control": control}
    for split, attribute in (("heldout", "heldout_blocks"), ("other_domain", "other_blocks")):
        deltas = [
            [a - b for a, b in zip(getattr(by[(arm, s)], attribute), getattr(by[(control, s)], attribute), strict=True)]
            for s in seeds
        ]
        result[split] = {
            **two_level_bootstrap(deltas),
            "over_seeds_only": seed_interval([_mean(d) for d in deltas]),
            "per_seed": [{"seed": s, "delta": _mean(d)} for s, d in zip(seeds, deltas, strict=True)],
        }
    return result


def _interval(entry: dict) -> str:
    low_high = entry["ci95"]
    if low_high is None:
        return f"{entry['delta_mean']:+.4f} (no interval: one seed)"
    verdict = "excludes 0" if entry["excludes_zero"] else "includes 0"
    return f"{entry['delta_mean']:+.4f} [{low_high[0]:+.4f}, {low_high[1]:+.4f}] ({verdict})"


def print_report(summary: dict) -> None:
    print(
        f"\n{'arm':>12} {'lr':>8} {'trainable':>12} {'held-out before → after':>25} {'other domain before → after':>29}"
    )
    for arm, a in summary["arms"].items():
        print(
            f"{arm:>12} {a['lr']:>8g} {a['trainable_parameters']:>12,} "
            f"{a['heldout_before']:>11.4f} → {a['heldout_after_mean']:<11.4f} "
            f"{a['other_domain_before']:>13.4f} → {a['other_domain_after_mean']:.4f}"
        )
    for c in summary["comparisons"]:
        print(
            f"Δ ({c['arm']} − {c['control']}), held-out: {_interval(c['heldout'])}; "
            f"other domain: {_interval(c['other_domain'])}"
        )


def evaluate_arms(models: dict, tokenizer, limit: int, output: Path) -> list[dict]:
    """The quick suite on the first seed's models; paired statistics for each comparison."""
    from ..eval.compare import evaluate_loaded, new_task_manager
    from ..eval.paired import (
        PER_DOCUMENT_FILE,
        comparison_rows,
        markdown_table,
        per_document_records,
        write_per_document,
    )
    from ..eval.suites import SUITES

    task_manager = new_task_manager()  # indexes lm-eval's tasks once for every model
    settings = dict(tasks=SUITES["quick"], local=True, limit=limit, num_fewshot=None, batch_size=8, device="cpu")
    results = {}
    for arm, model in models.items():
        model = (model.merge_and_unload() if arm in MERGEABLE else model).eval()
        results[arm] = evaluate_loaded(arm, arm, model, tokenizer, **settings, seed=1234, task_manager=task_manager)
    tables, rows = [], []
    for arm, control in comparisons(list(models)):
        pair_rows = comparison_rows(results[control], results[arm])
        rows.append({"arm": arm, "control": control, "rows": pair_rows})
        table = markdown_table(pair_rows, results[control], results[arm])
        tables.append(f"### {arm} vs {control} (eval/{arm}-vs-{control})\n\n" + table)
        # each comparison's folder is a `kha eval` folder: `kha eval --recompute` re-derives its statistics
        folder = output / "eval" / f"{arm}-vs-{control}"
        folder.mkdir(parents=True)
        write_per_document(folder / PER_DOCUMENT_FILE, per_document_records(results[control], results[arm]))
        write_json(folder / "summary.json", {"baseline": control, "candidate": arm, "rows": pair_rows})
        (folder / "table.md").write_text(table + "\n")
    (output / "eval.md").write_text("\n".join(tables))
    print("\n".join(tables))
    return rows
