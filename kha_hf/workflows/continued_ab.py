"""`kha ab --from MODEL`: should I convert a real checkpoint to KHA before continued training?

MODEL (folder, Hub id or .gguf) is converted once; then four arms train with identical data, data order, steps,
optimiser and seeds:

- (a) `base-full`: the base model, every weight trained;          (b) `kha-full`: its KHA conversion, likewise.
- (c) `kha-knocks`: only the knocks of the conversion train;      (d) `lora-matched`: a LoRA on the projections the
  knocks act on (v_proj for mlp_v), with a rank whose trainable parameter count matches the knocks' within 5 %.

(b − a) asks whether KHA adds anything to full training; (c − d) whether the knocks beat any other parameters of the
same size added at the same place: a control that would help as much without KHA. Both differences are paired per
seed and reported with a 95 % t-interval over seeds. `run_eval=True` adds the quick lm-eval suite on the first seed's
models with the per-document paired statistics of `kha eval`.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from ..common.errors import KHAError
from ..common.loading import find_gguf, load_tokenizer
from ..common.output import atomic_output_dir
from ..common.paths import check_run_destination
from ..modeling.configuration_kha import KNOCK_PRESETS
from ..training.ab_report import (
    ArmRun,
    arm_summary,
    compare_arms,
    plot_mean_curves,
    print_comparison,
    write_curves_csv,
    write_json,
)
from ..training.arms import train_arm
from ..training.modes import MATCH_TOLERANCE, lora_targets, matched_lora_rank
from ..training.params import count_knock_parameters

ARMS = ("base-full", "kha-full", "kha-knocks", "lora-matched")
COMPARISONS = (("kha-full", "base-full"), ("kha-knocks", "lora-matched"))


def _trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def continued_ab(
    model: str,
    output: str | Path = "kha-ab-continued",
    knock: str = "mlp_v",
    max_steps: int = 24,
    seq_len: int = 128,
    batch_size: int = 4,
    lr_full: float = 5e-5,
    lr_small: float = 1e-3,
    data: list[str] | None = None,
    seed: int = 0,
    seeds: int = 3,
    max_eval_blocks: int = 16,
    run_eval: bool = False,
    limit: int = 100,
    tokenizer: str | None = None,
    trust_remote_code: bool = False,
    overwrite: bool = False,
) -> dict:
    """Run the four arms over SEEDS seeds; write loss_curves.csv/.png and summary.json to OUTPUT.

    OUTPUT follows the destination rules of `kha convert` and appears only when the run is complete (an existing
    one is replaced only with `overwrite`)."""
    from ..training.train import check_training_numbers

    check_training_numbers(max_steps=max_steps, seq_len=seq_len, batch_size=batch_size, seeds=seeds)
    if knock not in KNOCK_PRESETS:
        raise KHAError(f"unknown knock preset {knock!r}; choose one of: {', '.join(KNOCK_PRESETS)}")
    start = time.perf_counter()
    final = check_run_destination(output, [model, tokenizer], data, overwrite)
    with atomic_output_dir(final, overwrite=overwrite, marker="ab") as output:
        summary = _run(
            model,
            output,
            knock,
            max_steps,
            seq_len,
            batch_size,
            lr_full,
            lr_small,
            data,
            seed,
            seeds,
            max_eval_blocks,
            run_eval,
            limit,
            tokenizer,
            trust_remote_code,
        )
        summary["minutes"] = (time.perf_counter() - start) / 60
        write_json(output / "summary.json", summary)
    print(f"wrote {final / 'loss_curves.csv'}, {final / 'loss_curves.png'}, {final / 'summary.json'}")
    return summary


def _run(
    model,
    output: Path,
    knock,
    max_steps,
    seq_len,
    batch_size,
    lr_full,
    lr_small,
    data,
    seed,
    seeds,
    max_eval_blocks,
    run_eval,
    limit,
    tokenizer,
    trust_remote_code,
) -> dict:
    """The four arms over the seeds, written into OUTPUT (the run's temporary folder)."""
    from transformers import AutoModelForCausalLM

    from ..conversion import convert
    from ..conversion.source import dequantize_gguf, resolve_source
    from ..modeling.modeling_kha import KHAForCausalLM
    from ..training.data import read_documents, train_heldout_split
    from ..training.modes import prepare_for_mode, with_lora

    # 1. one conversion; the base arms read the same (dequantised) weights
    source = resolve_source(model)
    base_dir = source.folder
    if find_gguf(Path(model)) is not None:
        base_dir = output / "base"
        print(f"dequantising {source.gguf_file.name} to {base_dir}")
        dequantize_gguf(source.gguf_file, base_dir)
    kha_dir = output / "kha"
    print(f"converting {base_dir} to KHA ({knock}) in {kha_dir}")
    convert(base_dir, kha_dir, knock=knock, link=True, progress=False)

    tok = load_tokenizer(base_dir, tokenizer, trust_remote_code)
    documents = read_documents(data)
    train_set, heldout_set = train_heldout_split(documents, tok, seq_len, max_heldout_blocks=max_eval_blocks)
    print(f"data: {len(train_set)} train / {len(heldout_set)} held-out blocks of {seq_len} tokens")

    def build(arm: str, run_seed: int) -> nn.Module:
        torch.manual_seed(run_seed)  # the LoRA A matrices are random
        if arm in ("kha-full", "kha-knocks"):
            built = KHAForCausalLM.from_pretrained(kha_dir, dtype=torch.float32)
            return prepare_for_mode(built, "full" if arm == "kha-full" else "knocks")
        built = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, trust_remote_code=trust_remote_code)
        if arm == "base-full":
            return built.requires_grad_(True)
        return with_lora(built, targets, rank)

    # 2. the matched control: LoRA rank from the knocks' parameter count
    probe = KHAForCausalLM.from_pretrained(kha_dir, dtype=torch.float32)
    knock_parameters = count_knock_parameters(probe)
    targets = lora_targets(knock)
    rank, lora_parameters = matched_lora_rank(probe, targets, knock_parameters)
    del probe
    mismatch = abs(lora_parameters - knock_parameters) / knock_parameters
    print(
        f"trainable parameters: knocks {knock_parameters:,}; LoRA r={rank} on {', '.join(targets)}: "
        f"{lora_parameters:,} ({mismatch:.1%} apart)"
    )
    if mismatch > MATCH_TOLERANCE:
        print(f"warning: no LoRA rank matches the knocks within {MATCH_TOLERANCE:.0%}; the control is approximate")

    runs: list[ArmRun] = []
    kept: dict[str, nn.Module] = {}
    before: dict[str, float] = {}
    for run_seed in range(seed, seed + seeds):
        for arm in ARMS:
            built = build(arm, run_seed)
            result = train_arm(
                built,
                arm,
                run_seed,
                output / "runs" / arm,
                train_set,
                heldout_set,
                max_steps,
                batch_size,
                lr_full if arm.endswith("-full") else lr_small,
                measure_before=arm not in before,
            )
            before.setdefault(arm, result.heldout_before)
            result.heldout_before = before[arm]
            result.trainable_parameters = _trainable(built)
            runs.append(result)
            print(
                f"seed {run_seed} {arm:>12}: held-out {result.heldout_before:.4f} -> {result.heldout_loss:.4f} "
                f"({result.trainable_parameters:,} trainable)"
            )
            if run_eval and run_seed == seed:
                kept[arm] = built.merge_and_unload() if arm == "lora-matched" else built

    comparisons = [compare_arms(runs, arm, control) for arm, control in COMPARISONS]
    summary = {
        "model": str(model),
        "knock": knock,
        "steps": max_steps,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "lr_full": lr_full,
        "lr_small": lr_small,
        "seeds": list(range(seed, seed + seeds)),
        "knock_parameters": knock_parameters,
        "lora": {"rank": rank, "targets": targets, "parameters": lora_parameters, "relative_difference": mismatch},
        "arms": arm_summary(runs),
        "comparisons": comparisons,
    }
    if run_eval:
        summary["eval"] = _evaluate_arms(kept, tok, limit, output)
    write_curves_csv(runs, output / "loss_curves.csv")
    plot_mean_curves(runs, output / "loss_curves.png", f"continued training from {Path(str(model)).name}")
    print(f"\n{'arm':>12} {'held-out before':>16} {'after (mean)':>13}")
    for arm, entry in summary["arms"].items():
        print(f"{arm:>12} {entry['heldout_before_mean']:>16.4f} {entry['heldout_loss_mean']:>13.4f}")
    for comparison in comparisons:
        print_comparison(comparison)
    return summary


def _evaluate_arms(models: dict, tokenizer, limit: int, output: Path) -> list[dict]:
    """The quick suite on the first seed's models; paired statistics for each comparison."""
    from lm_eval.tasks import TaskManager

    from ..eval.compare import comparison_rows, evaluate_loaded, markdown_table
    from ..eval.suites import SUITES

    task_manager = TaskManager()
    results = {
        arm: evaluate_loaded(
            arm, arm, model.eval(), tokenizer, SUITES["quick"], True, limit, None, 8, "cpu", 1234, task_manager
        )
        for arm, model in models.items()
    }
    tables, rows = [], []
    for arm, control in COMPARISONS:
        pair_rows = comparison_rows(results[control], results[arm])
        rows.append({"arm": arm, "control": control, "rows": pair_rows})
        tables.append(f"### {arm} vs {control}\n\n" + markdown_table(pair_rows, results[control], results[arm]))
    (output / "eval.md").write_text("\n".join(tables))
    print("\n".join(tables))
    return rows
