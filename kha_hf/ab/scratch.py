"""`kha ab`: train a baseline and its KHA twins from scratch, same seed, data order, steps and optimiser.

Each twin is built from a deep copy of the baseline's initial weights (`KHAForCausalLM.from_base`), so the runs differ
only by the knocks. One twin (`--knock`, the arm "kha"), or the paper's ablation in one command (`--variants`: every
named knock preset, each its own arm, against the one baseline). Optimiser: the paper's (AdamW, wd 0.1, betas
0.9/0.95, clip 1.0, 5 % warmup, cosine to 10 %). Repeated over seeds (new initial weights and data order each), the
paired differences give a 95 % t-interval. Every step records its loss, gradient norms and learning rate, the largest
attention logit per layer every `logit_every` steps (training/stability.py); loss spikes are counted from them.
Writes loss_curves.csv, loss_curves.png, stability.csv and summary.json. Each finished run is kept in the output's
temporary folder: an interrupted ablation started again with the same settings trains only what is missing.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig

from ..checkpoint.loading import load_tokenizer
from ..checkpoint.output import atomic_output_dir
from ..checkpoint.paths import check_run_destination, is_training_run
from ..common.errors import KHAError
from ..data.corpus import TOKENIZER_DIR
from ..modeling.modeling_kha import KHAForCausalLM
from ..training.corpus_data import MAX_PREPARED_EVAL_BLOCKS, corpus_splits, prepared_corpus
from ..training.data import read_documents, train_heldout_split, train_validation_heldout_split
from ..training.presets import PRESETS
from ..training.schedules import Schedule
from ..training.spikes import SPIKE_MARGIN, check_spike_margin
from ..training.tokenizer import train_bpe_tokenizer
from ..training.train import check_training_numbers
from .arm import ArmRun, train_arm
from .cache import SETTINGS_FILE, data_fingerprint, interrupted_run, keep
from .cache import cached as cached_run
from .scratch_report import write_report
from .variants import Variant, parse_variants

MODELS_DIR = "models"  # --save-models: every trained model, ARM-seedN
RANDOM_INIT_SEED = 1_000_003  # added to a seed for random knocks: their draw never shifts the shared weights'


def _base_config(base: str) -> PreTrainedConfig:
    if base in PRESETS:
        return PRESETS[base].config()
    path = Path(base)
    if path.exists():
        try:
            return AutoConfig.from_pretrained(path, trust_remote_code=False)
        except (OSError, ValueError) as err:
            raise KHAError(f"cannot read a model config from {path}: {err}") from err
    raise KHAError(f"{base!r} is neither an A/B preset ({', '.join(PRESETS)}) nor a config file or folder")


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
    variants: str | list[str] | None = None,
    logit_every: int | None = None,
    spike_margin: float = SPIKE_MARGIN,
    save_models: bool = False,
    max_eval_blocks: int | None = None,
    eval_steps: int | None = None,
    lr_scheduler: str = "cosine",
    warmup_steps: int | None = None,
    warmup_ratio: float | None = None,
    min_lr_ratio: float | None = None,
    decay_ratio: float | None = None,
    peak_flops: float | None = None,
) -> dict:
    """Run the A/B for SEEDS seeds (SEED, SEED+1, ...) and return the summary (also OUTPUT/summary.json).

    Each seed draws new initial weights and a new data order; the baseline and its KHA twins share both. With
    VARIANTS ('mlp_v,linear_v,gate_v,mlp_v_random', `variants.py`) every variant is a twin; else KNOCK is the one
    twin. LOGIT_EVERY: steps between attention-logit measurements (default: 50 per run). SPIKE_MARGIN: see
    `stability.spike_steps`. SAVE_MODELS: keep every trained model (OUTPUT/models/ARM-seedN, with the tokenizer), for
    `kha eval`. OUTPUT appears when the run is complete; an existing one is replaced only with `overwrite`.
    MAX_EVAL_BLOCKS: held-out (and validation) blocks evaluated (default: all of raw text's, 256 of a prepared
    corpus's). EVAL_STEPS: the validation split's loss every N steps (each run's curve in summary.json).
    LR_SCHEDULER and its numbers: training/schedules.py. PEAK_FLOPS: one device's peak, for the MFU in the logs.
    """
    check_training_numbers(
        max_steps=max_steps, seq_len=seq_len, batch_size=batch_size, seeds=seeds, max_eval_blocks=max_eval_blocks,
        eval_steps=eval_steps,
    )  # fmt: skip
    if lr is not None and not lr >= 0:
        raise KHAError(f"lr must be >= 0, got {lr}")
    try:
        spike_margin = check_spike_margin(spike_margin)
        twins = parse_variants(variants) if variants is not None else [Variant("kha", knock, "identity")]
    except ValueError as err:
        raise KHAError(str(err)) from err
    preset = PRESETS.get(base, PRESETS["cpu-tiny"])
    config = _base_config(base)
    steps, seq, batch = max_steps or preset.max_steps, seq_len or preset.seq_len, batch_size or preset.batch_size
    max_eval_blocks = max_eval_blocks or preset.eval_blocks
    check_training_numbers(logit_every=logit_every)
    schedule = Schedule(lr_scheduler, warmup_steps, warmup_ratio, min_lr_ratio, decay_ratio)
    schedule.training_arguments(steps)  # a choice that does not apply: refused before any data is read
    every = logit_every or max(1, steps // 50)
    final = check_run_destination(output, [base], data, overwrite)
    _check_twins_fit(config, twins)
    corpus = prepared_corpus(data)
    if corpus is not None:  # read lazily; every arm of every seed sees the same global order of its blocks
        tokenizer = load_tokenizer(corpus.folder / TOKENIZER_DIR, None, offer_trust=False)
        config.vocab_size = len(tokenizer)
        train_set, heldout_set = corpus_splits(corpus, tokenizer, seq, max_eval_blocks)
        validation_set = corpus.blocks("validation", seq, max_eval_blocks or MAX_PREPARED_EVAL_BLOCKS)
    else:  # raw text, checked by prepared_corpus to fit in memory
        documents = read_documents(data)
        tokenizer = train_bpe_tokenizer(documents, config.vocab_size)
        config.vocab_size = len(tokenizer)
        if eval_steps:  # the validation split comes from before the held-out tail, which stays the same
            train_set, validation_set, heldout_set = train_validation_heldout_split(
                documents, tokenizer, seq, max_eval_blocks=max_eval_blocks
            )
        else:
            train_set, heldout_set = train_heldout_split(documents, tokenizer, seq, max_heldout_blocks=max_eval_blocks)
            validation_set = None
    if eval_steps and len(validation_set) == 0:
        raise KHAError(f"the validation split holds less than one block of {seq} tokens: --eval-steps has nothing")
    lr = lr if lr is not None else preset.lr
    settings = {
        "config": config.to_dict(),
        "steps": steps,
        "seq_len": seq,
        "batch_size": batch,
        "lr": lr,
        "bf16": bf16,
        "logit_every": every,
        "data": data_fingerprint(data, len(train_set), len(heldout_set)),
        "kha_knock": knock if variants is None else None,  # the one twin's arm is "kha": its knock is a setting
        "save_models": save_models,
        "schedule": schedule.training_arguments(steps),
        "eval_steps": eval_steps,
    }
    settings["config"].pop("transformers_version", None)
    adopt = interrupted_run(final, settings)
    validation_note = f" / {len(validation_set)} validation" if eval_steps else ""
    print(f"data: {len(train_set)} train{validation_note} / {len(heldout_set)} held-out blocks of {seq} tokens")
    print(f"learning rate {lr:g}; schedule {schedule.describe(steps)}")

    kept_hint = "the same kha ab command again reuses its finished runs"
    with atomic_output_dir(
        final, overwrite=overwrite, marker="ab", keep_on_failure=is_training_run, adopt=adopt, kept_hint=kept_hint
    ) as output:
        (output / SETTINGS_FILE).write_text(json.dumps(settings, sort_keys=True, default=str) + "\n")
        # what every run shares: `arm.train_arm`'s arguments
        train = dict(
            train_set=train_set, heldout_set=heldout_set, steps=steps, batch_size=batch, lr=lr, measure_before=False,
            disable_tqdm=disable_tqdm, logging_steps=logging_steps or max(1, steps // 50), bf16=bf16,
            stability_every=every, schedule=schedule, eval_steps=eval_steps,
            validation_set=validation_set if eval_steps else None, peak_flops=peak_flops,
        )  # fmt: skip
        save = (output / MODELS_DIR, tokenizer) if save_models else None  # with --save-models
        runs = _train_arms(config, twins, seed, seeds, output, train, save)
        label = knock if variants is None else ",".join(t.name for t in twins)
        return write_report(
            runs, output, label, config, steps, final, twins if variants is not None else None, spike_margin
        )


def _check_twins_fit(config, twins: list[Variant]) -> None:
    """Every twin's knocks fit the base (an MLP on MLA is refused here, before any data is read)."""
    from ..modeling.configuration_kha import KHAConfig

    for twin in twins:
        try:
            KHAConfig.from_base(config, knock=twin.knock, knock_init=twin.knock_init)
        except ValueError as err:
            raise KHAError(f"variant {twin.name}: {err}") from err


def _train_arms(config, twins: list[Variant], seed: int, seeds: int, output: Path, train: dict, save) -> list[ArmRun]:
    runs: list[ArmRun] = []
    for run_seed in range(seed, seed + seeds):
        torch.manual_seed(run_seed)
        baseline = AutoModelForCausalLM.from_config(config)
        if run_seed == seed:
            n_params = sum(p.numel() for p in baseline.parameters())
            print(
                f"baseline {config.model_type}: {n_params / 1e6:.1f}M parameters; twins: "
                + ", ".join(t.name if t.name != "kha" else t.knock for t in twins)
            )
        for name, twin in (("baseline", None), *((t.name, t) for t in twins)):
            cached = cached_run(output, name, run_seed)
            if cached is not None:
                print(f"seed {run_seed}: {name} taken from the run cache")
                runs.append(cached)
                continue
            model = baseline if twin is None else _twin(baseline, twin, run_seed)
            print(f"seed {run_seed}: training {name} ({train['steps']} steps)")
            run = _train_one(model, name, run_seed, output, train, save)
            keep(output, run)
            runs.append(run)
    return runs


def _twin(baseline, twin: Variant, run_seed: int):
    """BASELINE's initial weights (a deep copy: the baseline trains on its own) with TWIN's knocks; random knocks
    are drawn from their own seed, so every arm's shared weights are the same whatever the order."""
    untrained = copy.deepcopy(baseline)
    if twin.knock_init == "random":
        torch.manual_seed(run_seed + RANDOM_INIT_SEED)
    try:
        return KHAForCausalLM.from_base(untrained, knock=twin.knock, knock_init=twin.knock_init)
    except ValueError as err:
        raise KHAError(f"variant {twin.name}: {err}") from err


def _train_one(model, name: str, run_seed: int, output: Path, train: dict, save) -> ArmRun:
    if name == "baseline":
        model = copy.deepcopy(model)  # the untrained baseline stays the twins' starting point
    run = train_arm(model, name, run_seed, output / name, **train)
    if save is not None:  # before the run is cached: a cached run's model is there too
        model.save_pretrained(save[0] / f"{name}-seed{run_seed}")
        save[1].save_pretrained(save[0] / f"{name}-seed{run_seed}")
    return run
