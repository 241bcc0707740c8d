"""`kha ab`: train a baseline and its KHA twin from scratch, same seed, data order, steps and optimiser.

The KHA twin is built from a deep copy of the baseline's initial weights (`KHAForCausalLM.from_base`), so the two
runs differ only by the knocks. Optimiser: the paper's (AdamW, wd 0.1, betas 0.9/0.95, clip 1.0, 5 % warmup,
cosine to 10 %). Writes loss_curves.csv, loss_curves.png and summary.json.
"""

from __future__ import annotations

import copy
import csv
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig, Qwen3Config

from ..errors import KHAError
from ..modeling_kha import KHAForCausalLM
from .data import read_documents, train_heldout_split
from .tokenizer import train_bpe_tokenizer
from .train import paper_training_arguments
from .trainer import KHATrainer


@dataclass(frozen=True)
class ABPreset:
    """A Qwen3-style (QK norm, GQA) model and its run: the paper's attention setting, scaled."""

    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    seq_len: int
    batch_size: int
    max_steps: int
    lr: float

    def config(self) -> Qwen3Config:
        return Qwen3Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.hidden_size * 3,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=max(4096, self.seq_len),
            tie_word_embeddings=True,
        )


AB_PRESETS = {
    # about 10 minutes for both runs on 2 CPU cores
    "cpu-tiny": ABPreset(256, 4, 8, 2, 32, 4096, 256, 8, 600, 3e-3),
    # one GPU, minutes
    "gpu-small": ABPreset(768, 12, 12, 4, 64, 8192, 1024, 16, 2000, 1e-3),
    # the paper's attention shape (32 query / 4 KV heads, head_dim 128): hours on one GPU
    "paper": ABPreset(2048, 16, 32, 4, 128, 16384, 2048, 16, 5000, 6e-4),
}


@dataclass
class ABRun:
    name: str
    curve: list[tuple[int, float]]
    train_loss: float  # last logged training loss (mean over its logging window)
    heldout_loss: float


def _base_config(base: str, preset: ABPreset) -> PreTrainedConfig:
    if base in AB_PRESETS:
        return AB_PRESETS[base].config()
    path = Path(base)
    if path.exists():
        return AutoConfig.from_pretrained(path)
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
    bf16: bool = False,
    logging_steps: int | None = None,
    disable_tqdm: bool = False,
) -> dict:
    """Run the A/B and return the summary (also written to OUTPUT/summary.json)."""
    preset = AB_PRESETS.get(base, AB_PRESETS["cpu-tiny"])
    config = _base_config(base, preset)
    steps, seq, batch = max_steps or preset.max_steps, seq_len or preset.seq_len, batch_size or preset.batch_size
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)

    documents = read_documents(data)
    tokenizer = train_bpe_tokenizer(documents, config.vocab_size)
    config.vocab_size = len(tokenizer)
    train_set, heldout_set = train_heldout_split(documents, tokenizer, seq)
    print(f"data: {len(train_set)} train / {len(heldout_set)} held-out blocks of {seq} tokens")

    torch.manual_seed(seed)
    baseline = AutoModelForCausalLM.from_config(config)
    try:
        kha = KHAForCausalLM.from_base(copy.deepcopy(baseline), knock=knock)
    except ValueError as err:
        raise KHAError(str(err)) from err
    n_params = sum(p.numel() for p in baseline.parameters())
    print(f"baseline {config.model_type}: {n_params / 1e6:.1f}M parameters; KHA twin adds {knock}")

    runs = []
    for name, model in (("baseline", baseline), ("kha", kha)):
        args = paper_training_arguments(
            output / name,
            max_steps=steps,
            per_device_train_batch_size=batch,
            per_device_eval_batch_size=batch,
            learning_rate=lr or preset.lr,
            logging_steps=logging_steps or max(1, steps // 50),
            save_strategy="no",
            seed=seed,
            data_seed=seed,
            bf16=bf16,
            disable_tqdm=disable_tqdm,
        )
        trainer = KHATrainer(model=model, args=args, train_dataset=train_set, eval_dataset=heldout_set)
        trainer.train()
        heldout = trainer.evaluate()["eval_loss"]
        curve = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
        runs.append(ABRun(name, curve, curve[-1][1], heldout))
    return write_report(runs, output, knock, config, steps)


def write_report(runs: list[ABRun], output: Path, knock: str, config, steps: int) -> dict:
    baseline, kha = runs
    with open(output / "loss_curves.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "baseline_loss", "kha_loss"])
        for (step, b), (_, k) in zip(baseline.curve, kha.curve, strict=True):
            writer.writerow([step, f"{b:.5f}", f"{k:.5f}"])
    summary = {
        "knock": knock,
        "base_model_type": config.model_type,
        "steps": steps,
        "baseline": {"train_loss": baseline.train_loss, "heldout_loss": baseline.heldout_loss},
        "kha": {"train_loss": kha.train_loss, "heldout_loss": kha.heldout_loss},
        "delta_train_loss": kha.train_loss - baseline.train_loss,
        "delta_heldout_loss": kha.heldout_loss - baseline.heldout_loss,
    }
    (output / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _plot(runs, output / "loss_curves.png", knock)
    print(f"{'':10} {'train loss':>11} {'held-out loss':>14}")
    for run in runs:
        print(f"{run.name:10} {run.train_loss:>11.4f} {run.heldout_loss:>14.4f}")
    print(f"{'Δ (KHA−base)':10} {summary['delta_train_loss']:>+11.4f} {summary['delta_heldout_loss']:>+14.4f}")
    print(f"wrote {output / 'loss_curves.csv'}, {output / 'loss_curves.png'}, {output / 'summary.json'}")
    return summary


def _plot(runs: list[ABRun], path: Path, knock: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run, color in zip(runs, ("tab:gray", "tab:red"), strict=True):
        steps, losses = zip(*run.curve, strict=True)
        ax.plot(steps, losses, label=f"{run.name} (held-out {run.heldout_loss:.3f})", color=color)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"from-scratch A/B: baseline vs KHA ({knock})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
