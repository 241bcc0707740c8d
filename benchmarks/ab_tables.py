"""The docs' A/B tables, printed from the summary.json that `kha ab` wrote (kept under docs/ab_runs/ and
docs/ab_adapters/; tests/docs/test_ab_tables.py checks that docs/does-kha-help.md holds every row printed here).

    python benchmarks/ab_tables.py scratch docs/ab_runs/scratch_cpu_tiny.json
    python benchmarks/ab_tables.py continued "SmolLM2-135M:Shakespeare:docs/ab_runs/continued_smollm2.json"
    python benchmarks/ab_tables.py adapters "SmolLM2-135M:Shakespeare:docs/ab_adapters/smollm2_shakespeare.json" ...
    python benchmarks/ab_tables.py ablation docs/ab_runs/ablation_cpu_tiny_moe.json
    python benchmarks/ab_tables.py costs

scratch: the from-scratch A/B (`kha ab`), one row per seed and the mean paired difference with its 95 % t-interval
over seeds. continued and adapters: the runs of `kha ab --from MODEL` (four arms) and `kha ab --from MODEL --arms
adapters`; one row per arm (learning rates tried and chosen, loss before and after, minutes per run) and one per
paired comparison (95 % intervals over seeds and blocks, bold where they exclude 0). For continued also each arm's
validation loss at every rate tried, and each comparison's per-seed differences with the t-interval over the seeds'
means. Each MODEL:DOMAIN:SUMMARY names the run's model and training domain as the table shows them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ARM_HEADER = (
    "| model | domain | arm | trainable | lr tried → chosen | held-out loss before → after | "
    "Wikipedia loss before → after | minutes/run |\n|---|---|---|---|---|---|---|---|"
)


def signed(x: float, digits: int = 4) -> str:
    return f"{x:+.{digits}f}".replace("-", "−")


def interval(stats: dict) -> str:
    """`+0.0190 [−0.0345, +0.0725]`, bold where the interval excludes 0."""
    low, high = stats["ci95"]
    text = f"{signed(stats['delta_mean'])} [{signed(low)}, {signed(high)}]"
    return f"**{text}**" if stats["excludes_zero"] else text


def scratch_rows(summary: dict) -> list[str]:
    """The from-scratch table: held-out loss per seed for both arms and their paired difference."""
    knock = summary["knock"]
    rows = [
        f"| seed | baseline held-out loss | KHA ({knock}) held-out loss | Δ (KHA − baseline) [95 % CI] |",
        "|---|---|---|---|",
    ]
    for row in summary["per_seed"]:
        rows.append(
            f"| {row['seed']} | {row['baseline_heldout']:.4f} | {row['kha_heldout']:.4f} | {signed(row['delta'])} |"
        )
    arms = summary["arms"]
    rows.append(
        f"| mean | {arms['baseline']['heldout_loss_mean']:.4f} | {arms['kha']['heldout_loss_mean']:.4f} | "
        f"{interval(summary)} |"
    )
    return rows


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


def pair_header(summaries: list[dict]) -> str:
    """The comparisons' header, naming their seeds and blocks (one table: every run must share them)."""
    shapes = {(c["heldout"]["n_seeds"], c["heldout"]["n_blocks"]) for s in summaries for c in s["comparisons"]}
    if len(shapes) != 1:
        sys.exit(f"ab_tables.py: these runs differ in seeds x blocks {sorted(shapes)}: print them one at a time")
    ((seeds, n_blocks),) = shapes
    return (
        f"| model | domain | paired difference ({seeds} seeds x {n_blocks} blocks) | "
        "Δ held-out loss [95 % CI] | Δ Wikipedia loss [95 % CI] |\n|---|---|---|---|---|"
    )


def pair_rows(model: str, domain: str, summary: dict) -> list[str]:
    return [
        f"| {model} | {domain} | {c['arm']} − {c['control']} | {interval(c['heldout'])} | "
        f"{interval(c['other_domain'])} |"
        for c in summary["comparisons"]
    ]


def tuning_rows(summary: dict) -> list[str]:
    """Each arm's validation loss at every rate tried (the first seed), the chosen one in bold."""
    rows = ["| arm | validation loss at each rate tried | chosen |", "|---|---|---|"]
    for name, arm in summary["arms"].items():
        tried = ", ".join(
            f"{t['lr']:.3g}: "
            + (f"**{t['validation_loss']:.3f}**" if t["lr"] == arm["lr"] else f"{t['validation_loss']:.3f}")
            for t in summary["tuning"][name]
        )
        rows.append(f"| {name} | {tried} | {arm['lr']:.3g} |")
    return rows


def seed_rows(summary: dict) -> list[str]:
    """Each comparison's per-seed mean differences and the t-interval over those means (a check on the bootstrap)."""
    rows = ["| paired difference | split | Δ per seed | 95 % t-interval over the seeds' means |", "|---|---|---|---|"]
    for c in summary["comparisons"]:
        for split, label in (("heldout", "held-out"), ("other_domain", "Wikipedia")):
            per_seed = ", ".join(signed(s["delta"], 3) for s in c[split]["per_seed"])
            rows.append(
                f"| {c['arm']} − {c['control']} | {label} | {per_seed} | {interval(c[split]['over_seeds_only'])} |"
            )
    return rows


def ablation_rows(summary: dict) -> list[str]:
    """The paper's ablation layout from a `kha ab --variants` summary: per variant the paired Δ held-out loss over
    seeds, the loss spikes per run (baseline → variant, with the paired difference), the largest gradient norm, and
    the paper's Δ beside it."""
    stability = summary["stability"]["arms"]
    base = stability["baseline"]
    rows = [
        f"| variant | Δ held-out loss vs baseline [95 % CI], {len(summary['seeds'])} seeds | loss spikes per run "
        f"(baseline → variant) | largest gradient norm (baseline → variant) | paper's Δ ({summary['paper_setting']}) |",
        "|---|---|---|---|---|",
    ]
    for name, entry in summary["variants"].items():
        arm = stability[name]
        paper = entry["paper_delta"]
        paper_text = (
            "higher (no number)"
            if paper is None and name.endswith("_random")
            else ("—" if paper is None else signed(paper, 3))
        )
        rows.append(
            f"| {name} | {interval(entry)} | {base['spikes_mean']:.1f} → {arm['spikes_mean']:.1f} | "
            f"{base['max_grad_norm_mean']:.3g} → {arm['max_grad_norm_mean']:.3g} | {paper_text} |"
        )
    return rows


def cost_rows(seeds: int = 3, mfu: float = 0.4, peak: float = 989e12) -> list[str]:
    """Per preset of `kha ab`: parameters (active per token for MoE), tokens per run, and the GPU hours of one run
    and of the paper's ablation (a baseline and 10 variants, SEEDS seeds), from 6 x (active parameters + layers x
    context x attention width) FLOPs per token (Kaplan et al. 2020) at MFU of an H100's bf16 dense PEAK. An
    estimate: no GPU ran here; measure with benchmarks/train_step.py. The last two rows: paper-moe at the paper's
    75B-token ablation runs and its 1T-token run."""
    import torch
    from transformers import AutoModelForCausalLM

    from kha_hf.ab.variants import PAPER_ABLATION
    from kha_hf.training.presets import PRESETS

    arms = 1 + len(PAPER_ABLATION.split(","))
    rows = [
        f"| preset | parameters (active) | tokens per run | H100 hours per run | H100 hours, ablation ({arms} arms x "
        f"{seeds} seeds) |",
        "|---|---|---|---|---|",
    ]
    runs = [(name, preset, preset.max_steps) for name, preset in PRESETS.items() if not name.startswith("cpu")]
    moe = PRESETS["paper-moe"]
    for paper_tokens in (75e9, 1e12):  # the paper's ablation runs, and its main run
        runs.append(("paper-moe", moe, round(paper_tokens / (moe.batch_size * moe.seq_len))))
    for name, preset, steps in runs:
        with torch.device("meta"):
            total = sum(p.numel() for p in AutoModelForCausalLM.from_config(preset.config()).parameters())
        idle = preset.layers * (preset.experts - preset.active) * 3 * preset.hidden_size * preset.expert_size
        active = total - idle
        tokens = steps * preset.batch_size * preset.seq_len
        if steps != preset.max_steps:
            name = f"{name} --max-steps {steps}"
        attention = 6 * preset.layers * preset.seq_len * preset.heads * preset.head_dim  # q·k and weights·v, per token
        hours = (6 * active + attention) * tokens / (mfu * peak) / 3600
        shown = f"{total / 1e9:.2f}B ({active / 1e9:.2f}B)" if preset.experts else f"{total / 1e9:.2f}B"
        size = f"{tokens / 1e9:.0f}B" if tokens >= 1e9 else f"{tokens / 1e6:.0f}M"
        rows.append(f"| {name} | {shown} | {size} | {hours:,.2f} | {hours * arms * seeds:,.1f} |")
    return rows


def _runs(args: list[str]) -> list[tuple[str, str, dict]]:
    runs = []
    for arg in args:
        model, domain, path = arg.split(":", 2)
        runs.append((model, domain, json.loads(Path(path).read_text())))
    return runs


def main(argv: list[str]) -> int:
    if argv[:1] == ["costs"]:
        print("\n".join(cost_rows()))
        return 0
    if len(argv) < 2 or argv[0] not in ("scratch", "continued", "adapters", "ablation"):
        sys.exit(__doc__)
    kind, args = argv[0], argv[1:]
    if kind == "ablation":
        for path in args:
            print("\n".join(ablation_rows(json.loads(Path(path).read_text()))))
        return 0
    if kind == "scratch":
        for path in args:
            print("\n".join(scratch_rows(json.loads(Path(path).read_text()))))
        return 0
    runs = _runs(args)
    print(ARM_HEADER)
    for run in runs:
        print("\n".join(arm_rows(*run)))
    print()
    print(pair_header([summary for _, _, summary in runs]))
    for run in runs:
        print("\n".join(pair_rows(*run)))
    if kind == "continued":
        for run in runs:
            print()
            print("\n".join(tuning_rows(run[2])))
            print()
            print("\n".join(seed_rows(run[2])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
