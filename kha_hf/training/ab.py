"""`kha ab`: train a baseline and its KHA twin from scratch, same seed, data order, steps and optimiser.

The KHA twin is built from a deep copy of the baseline's initial weights (`KHAForCausalLM.from_base`), so the two
runs differ only by the knocks. Optimiser: the paper's (AdamW, wd 0.1, betas 0.9/0.95, clip 1.0, 5 % warmup,
cosine to 10 %). Repeated over seeds (new initial weights and data order each), the paired differences give a
95 % t-interval. Writes loss_curves.csv, loss_curves.png and summary.json.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig

from ..common.errors import KHAError
from ..common.loading import load_tokenizer
from ..common.output import atomic_output_dir
from ..common.paths import check_run_destination
from ..data.corpus import TOKENIZER_DIR
from ..modeling.modeling_kha import KHAForCausalLM
from .ab_presets import AB_PRESETS, ABPreset
from .ab_report import (
    ArmRun,
    arm_summary,
    compare_arms,
    plot_mean_curves,
    print_comparison,
    write_curves_csv,
    write_json,
)
from .corpus_data import check_raw_data_fits, corpus_splits, prepared_corpus
from .data import read_documents, train_heldout_split
from .tokenizer import train_bpe_tokenizer
from .train import check_training_numbers, paper_training_arguments
from .trainer import KHATrainer


def _base_config(base: str, preset: ABPreset) -> PreTrainedConfig:
    if base in AB_PRESETS:
        return AB_PRESETS[base].config()
    path = Path(base)
    if path.exists():
        try:
            return AutoConfig.from_pretrained(path, trust_remote_code=False)
        except (OSError, ValueError) as err:
            raise KHAError(f"cannot read a model config from {path}: {err}") from err
    raise KHAError(f"{base!r} is neither an A/B preset ({', '.join(AB_PRESETS)}) nor a config file or folder")


def ab(
    base: str = "cpu-tiny",
    knock: str = "mlp_v",
    output: str | Path = "kha-ab",
    max_steps: int | None = None,
    seq_len: int | None = None,
    batch_size: int | None = None,
    lr: float | None = None,
    data: list[str] | None = None,
    seed: int = 0,
    seeds: int = 3,
    bf16: bool = False,
    logging_steps: int | None = None,
    disable_tqdm: bool = False,
    overwrite: bool = False,
) -> dict:
    """Run the A/B for SEEDS seeds (SEED, SEED+1, ...) and return the summary (also OUTPUT/summary.json).

    Each seed draws new initial weights and a new data order; the baseline and its KHA twin share both. OUTPUT
    appears when the run is complete; an existing one is replaced only with `overwrite`.
    """
    check_training_numbers(max_steps=max_steps, seq_len=seq_len, batch_size=batch_size, seeds=seeds)
    if lr is not None and not lr >= 0:
        raise KHAError(f"lr must be >= 0, got {lr}")
    preset = AB_PRESETS.get(base, AB_PRESETS["cpu-tiny"])
    config = _base_config(base, preset)
    steps, seq, batch = max_steps or preset.max_steps, seq_len or preset.seq_len, batch_size or preset.batch_size
    final = check_run_destination(output, [base], data, overwrite)
    corpus = prepared_corpus(data)
    if corpus is not None:  # read lazily; both arms of every seed see the same global order of its blocks
        tokenizer = load_tokenizer(corpus.folder / TOKENIZER_DIR, None, offer_trust=False)
        config.vocab_size = len(tokenizer)
        train_set, heldout_set = corpus_splits(corpus, tokenizer, seq)
    else:
        check_raw_data_fits(data)
        documents = read_documents(data)
        tokenizer = train_bpe_tokenizer(documents, config.vocab_size)
        config.vocab_size = len(tokenizer)
        train_set, heldout_set = train_heldout_split(documents, tokenizer, seq)
    print(f"data: {len(train_set)} train / {len(heldout_set)} held-out blocks of {seq} tokens")

    with atomic_output_dir(final, overwrite=overwrite, marker="ab") as output:
        runs = _train_pairs(
            config,
            knock,
            output,
            train_set,
            heldout_set,
            steps,
            seq,
            batch,
            lr if lr is not None else preset.lr,
            seed,
            seeds,
            bf16,
            logging_steps,
            disable_tqdm,
        )
        return write_report(runs, output, knock, config, steps, final)


def _train_pairs(
    config, knock, output, train_set, heldout_set, steps, seq, batch, lr, seed, seeds, bf16, logging_steps, disable_tqdm
) -> list[ArmRun]:
    runs: list[ArmRun] = []
    for run_seed in range(seed, seed + seeds):
        torch.manual_seed(run_seed)
        baseline = AutoModelForCausalLM.from_config(config)
        try:
            kha = KHAForCausalLM.from_base(copy.deepcopy(baseline), knock=knock)
        except ValueError as err:
            raise KHAError(str(err)) from err
        if run_seed == seed:
            n_params = sum(p.numel() for p in baseline.parameters())
            print(f"baseline {config.model_type}: {n_params / 1e6:.1f}M parameters; KHA twin adds {knock}")
        for name, model in (("baseline", baseline), ("kha", kha)):
            print(f"seed {run_seed}: training {name} ({steps} steps)")
            args = paper_training_arguments(
                output / name,
                max_steps=steps,
                per_device_train_batch_size=batch,
                per_device_eval_batch_size=batch,
                learning_rate=lr,
                logging_steps=logging_steps or max(1, steps // 50),
                save_strategy="no",
                seed=run_seed,
                data_seed=run_seed,
                bf16=bf16,
                disable_tqdm=disable_tqdm,
            )
            trainer = KHATrainer(model=model, args=args, train_dataset=train_set, eval_dataset=heldout_set)
            trainer.train()
            heldout = trainer.evaluate()["eval_loss"]
            curve = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
            runs.append(ArmRun(name, run_seed, curve, curve[-1][1], heldout))
    return runs


def write_report(runs: list[ArmRun], output: Path, knock: str, config, steps: int, final: Path | None = None) -> dict:
    """Write the CSV, JSON and PNG into OUTPUT and print the comparison; FINAL: where OUTPUT will be moved."""
    final = final or output
    comparison = compare_arms(runs, "kha", "baseline")
    arms = arm_summary(runs)
    summary = {
        "knock": knock,
        "base_model_type": config.model_type,
        "steps": steps,
        "seeds": sorted({r.seed for r in runs}),
        "delta_mean": comparison["delta_mean"],
        "ci95": comparison["ci95"],
        "excludes_zero": comparison["excludes_zero"],
        "per_seed": comparison["per_seed"],
        "arms": arms,
    }
    write_curves_csv(runs, output / "loss_curves.csv")
    write_json(output / "summary.json", summary)
    plot_mean_curves(runs, output / "loss_curves.png", f"from-scratch A/B: baseline vs KHA ({knock})")
    print(f"{'seed':>6} {'baseline':>10} {'KHA':>10} {'Δ':>9}   (held-out loss)")
    for row in comparison["per_seed"]:
        print(f"{row['seed']:>6} {row['baseline_heldout']:>10.4f} {row['kha_heldout']:>10.4f} {row['delta']:>+9.4f}")
    print_comparison(comparison)
    print(f"wrote {final / 'loss_curves.csv'}, {final / 'loss_curves.png'}, {final / 'summary.json'}")
    return summary
