"""The docs' rows from the summary.json of `kha ab --from MODEL --arms adapters` runs (docs/ab_adapters/*.json).

    python benchmarks/ab_adapters_table.py "SmolLM2-135M:Shakespeare:docs/ab_adapters/smollm2_shakespeare.json" ...

Prints the two tables of docs/does-kha-help.md's "The knock adapter against LoRA, IA3 and OFT" (README quotes
some of its rows): one row per arm (learning
rates tried and chosen, loss before and after, minutes per run) and one per paired comparison (95 % intervals over
seeds and blocks, bold where they exclude 0). Each argument is MODEL:DOMAIN:SUMMARY.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ARM_HEADER = (
    "| model | domain | arm | trainable | lr tried → chosen | held-out loss before → after | "
    "Wikipedia loss before → after | minutes/run |\n|---|---|---|---|---|---|---|---|"
)
PAIR_HEADER = (
    "| model | domain | paired difference (3 seeds x 16 blocks) | Δ held-out loss [95 % CI] | "
    "Δ Wikipedia loss [95 % CI] |\n|---|---|---|---|---|"
)


def signed(x: float) -> str:
    return f"{x:+.4f}".replace("-", "−")


def interval(stats: dict) -> str:
    """`+0.0190 [−0.0345, +0.0725]`, bold where the interval excludes 0."""
    low, high = stats["ci95"]
    text = f"{signed(stats['delta_mean'])} [{signed(low)}, {signed(high)}]"
    return f"**{text}**" if stats["excludes_zero"] else text


def arm_rows(model: str, domain: str, summary: dict) -> list[str]:
    rows = []
    for name, arm in summary["arms"].items():
        tried = " / ".join(f"{t['lr']:.3g}" for t in summary["tuning"][name])
        minutes = sum(arm["wall_seconds"]) / len(arm["wall_seconds"]) / 60
        rows.append(
            f"| {model} | {domain} | {name} | {arm['trainable_parameters']:,} | {tried} → **{arm['lr']:.3g}** | "
            f"{arm['heldout_before']:.3f} → {arm['heldout_after_mean']:.3f} | "
            f"{arm['other_domain_before']:.3f} → {arm['other_domain_after_mean']:.3f} | {minutes:.1f} |"
        )
    return rows


def pair_rows(model: str, domain: str, summary: dict) -> list[str]:
    return [
        f"| {model} | {domain} | {c['arm']} − {c['control']} | {interval(c['heldout'])} | "
        f"{interval(c['other_domain'])} |"
        for c in summary["comparisons"]
    ]


def main(argv: list[str]) -> int:
    if not argv:
        sys.exit(__doc__)
    runs = []
    for arg in argv:
        model, domain, path = arg.split(":", 2)
        runs.append((model, domain, json.loads(Path(path).read_text())))
    print(ARM_HEADER)
    for run in runs:
        print("\n".join(arm_rows(*run)))
    print()
    print(PAIR_HEADER)
    for run in runs:
        print("\n".join(pair_rows(*run)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
