"""`kha ab --from MODEL`: should I convert a real checkpoint to KHA before continued training, and do the knocks
beat a control of their size?

MODEL (folder, Hub id or .gguf) is converted once if an arm starts from the conversion (b, c); the chosen arms
(`arms`; by default the first four) then train with identical data, data order, steps and optimiser:

- (a) `base-full`: the base model, every weight trained;          (b) `kha-full`: its KHA conversion, likewise.
- (c) `kha-knocks`: only the knocks of the conversion train;      (d) `lora-matched`: a LoRA on the projections the
  knocks act on (v_proj for mlp_v), at the rank whose parameter count is closest to the knocks' (exact for mlp_v;
  the report says how far apart the counts are otherwise).
- (e) `knock-adapter`: the same knocks as a PEFT adapter on the stock model (`KnockConfig`; no conversion);
  (f) `ia3`: PEFT's IA3 at its standard placement; (g) `oft`: PEFT's OFT on o_proj with one orthogonal
  head_dim-sized block shared by all heads (an orthogonal value knock, as attention is linear in V). IA3 and
  OFT have the sizes their structure gives (reported beside the knocks'); no rank makes them match.
  `ADAPTER_ARMS` (e, d, f, g) is the comparison for people who fine-tune with PEFT.

A fair comparison needs each arm at its own best setting. Each arm's learning rate is chosen from a small grid
(`lr_grid_full` for a/b, `lr_grid_small` for every adapter arm) by its loss on a validation split that the
reported held-out split never touches (train / validation / held-out are consecutive, disjoint parts of the packed
corpus). No adapter arm gets weight decay (the knocks never do; the others are treated the same). Tuning runs at
the first seed.

Then every arm trains at its chosen rate for SEEDS seeds. A seed sets the data order (which training blocks form
each batch, and in what order) and the LoRA's random initialisation; every arm starts from the same pretrained
weights. Held-out loss is measured per block, on the corpus's held-out tail and on text of another domain
(Wikipedia paragraphs, `data.OTHER_DOMAIN`) before and after training: the second says what training on the corpus
costs elsewhere ("forgetting"). The comparisons (b − a, c − d, e − d, e − f, e − g) are paired per seed and per
block, and their 95 % interval resamples both seeds and blocks (`statistics.two_level_bootstrap`), so it carries
the spread between seeds and the sampling error of the blocks. When an arm's best rate is at the edge of its grid, up to
`grid_extensions` more rates are tried one step beyond that edge (the step of the grid's outermost pair): a
control whose best rate the grid missed is not a tuned control. A best rate still at the edge is flagged in the
summary (`at_grid_edge`). Each arm reports trainable parameters, estimated training FLOPs and wall time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.loading import find_gguf, load_tokenizer
from ..checkpoint.output import atomic_output_dir
from ..checkpoint.paths import check_run_destination
from ..checkpoint.reader import check_not_task_head
from ..common.errors import KHAError
from ..modeling.configuration_kha import CONTROL_PRESETS, KNOCK_PRESETS, control_refusal
from ..training.block_losses import block_losses
from ..training.modes import lora_targets, matched_lora_rank
from ..training.params import count_knock_parameters
from .arm import ArmRun, train_arm
from .cache import RunCache, blocks_digest, check_cache_dir
from .continued_report import arm_table, compare, comparisons, evaluate_arms, print_report
from .options import ADAPTER_ARMS, ARMS, DEFAULT_ARMS, EVAL_LIMIT, GRID_EXTENSIONS, LR_GRID_FULL, LR_GRID_SMALL
from .report import plot_mean_curves, write_curves_csv, write_json

KHA_ARMS = ("kha-full", "kha-knocks")  # start from the conversion; the others from the stock model


@dataclass
class ContinuedAB:
    """The settings of one `kha ab --from` run (see the module docstring)."""

    model: str
    knock: str = "mlp_v"
    arms: tuple[str, ...] = DEFAULT_ARMS
    max_steps: int = 24
    seq_len: int = 128
    batch_size: int = 4
    lr_grid_full: tuple[float, ...] = LR_GRID_FULL
    lr_grid_small: tuple[float, ...] = LR_GRID_SMALL
    grid_extensions: int = GRID_EXTENSIONS  # rates tried beyond a grid's edge when the best one is on it
    data: list[str] | None = None
    seed: int = 0
    seeds: int = 5
    eval_blocks: int = 16
    run_eval: bool = False
    limit: int = EVAL_LIMIT
    tokenizer: str | None = None
    trust_remote_code: bool = False
    run_cache: str | None = None  # a folder keeping each finished run's numbers, reused by a restarted A/B
    extra: dict = field(default_factory=dict)  # filled while running: data sizes, parameter matching

    def grid(self, arm: str) -> tuple[float, ...]:
        return self.lr_grid_full if arm.endswith("-full") else self.lr_grid_small


def continued_ab(settings: ContinuedAB, output: str | Path = "kha-ab-continued", overwrite: bool = False) -> dict:
    """Tune, run the four arms over the seeds, write loss_curves.csv/.png and summary.json to OUTPUT (which appears
    when the run is complete; an existing one is replaced only with `overwrite`)."""
    from ..training.train import check_training_numbers

    s = settings
    check_training_numbers(max_steps=s.max_steps, seq_len=s.seq_len, batch_size=s.batch_size, seeds=s.seeds)
    if s.knock not in KNOCK_PRESETS:
        raise KHAError(f"unknown knock preset {s.knock!r}; choose one of: {', '.join(KNOCK_PRESETS)}")
    if s.knock in CONTROL_PRESETS:  # continued training converts a real checkpoint: the method's knocks only
        raise KHAError(control_refusal(f"--knock {s.knock} is the gate-only value knock", "kha ab --from"))
    if isinstance(s.arms, str) or not isinstance(s.arms, (list, tuple)):
        raise KHAError(f"arms must be a list of arm names, got {s.arms!r}")
    if list(s.arms) == ["adapters"]:
        s.arms = ADAPTER_ARMS
    unknown = [arm for arm in s.arms if arm not in ARMS]
    if unknown or not s.arms or len(set(s.arms)) != len(s.arms):
        raise KHAError(
            f"arms must be distinct names from: {', '.join(ARMS)}, or ['adapters'] alone; got {list(s.arms)}"
        )
    if not isinstance(s.grid_extensions, int) or not 0 <= s.grid_extensions <= 10:
        raise KHAError(f"grid_extensions must be an integer from 0 to 10, got {s.grid_extensions!r}")
    for grid in (s.lr_grid_full, s.lr_grid_small):
        if not grid or any(not lr > 0 for lr in grid):
            raise KHAError(f"learning-rate grids need one or more positive rates, got {list(grid)}")
    start = time.perf_counter()
    final = check_run_destination(output, [s.model, s.tokenizer], s.data, overwrite)
    if Path(s.model).expanduser().is_dir():  # the arms train causal LMs: a reward model would get a random lm_head
        check_not_task_head(Path(s.model).expanduser())
    cache_dir = check_cache_dir(s.run_cache, final, s.model) if s.run_cache else None
    with atomic_output_dir(final, overwrite=overwrite, marker="ab") as work:
        summary = _run(s, work, cache_dir)
        summary["minutes"] = (time.perf_counter() - start) / 60
        write_json(work / "summary.json", summary)
    print(f"wrote {final / 'loss_curves.csv'}, {final / 'loss_curves.png'}, {final / 'summary.json'}")
    return summary


@dataclass
class _Prepared:
    base_dir: Path
    kha_dir: Path | None  # the conversion, made only for the arms that start from it (KHA_ARMS)
    tokenizer: object
    train: object
    validation: object
    heldout: object
    other: object
    targets: list[str]
    rank: int | None  # the LoRA control's, sized only when it runs
    knock: str
    cache: RunCache | None = None  # --run-cache


def _prepare(s: ContinuedAB, output: Path) -> _Prepared:
    """The base checkpoint (a GGUF dequantised), the conversion if a KHA arm needs it, the data splits, and the
    LoRA control's rank if it runs."""
    from ..conversion import convert
    from ..conversion.source import dequantize_gguf, resolve_source
    from ..data.corpus import SPLITS
    from ..training.corpus_data import prepared_corpus
    from ..training.data import OTHER_DOMAIN, other_domain_blocks, read_documents, train_validation_heldout_split

    source = resolve_source(s.model)
    base_dir = source.folder
    if find_gguf(Path(s.model)) is not None:
        base_dir = output / "base"
        print(f"dequantising {source.gguf_file.name} to {base_dir}")
        dequantize_gguf(source.gguf_file, base_dir)
    kha_dir = None
    if any(arm in KHA_ARMS for arm in s.arms):
        kha_dir = output / "kha"
        print(f"converting {base_dir} to KHA ({s.knock}) in {kha_dir}")
        convert(base_dir, kha_dir, knock=s.knock, link=True, progress=False)
    tokenizer = load_tokenizer(base_dir, s.tokenizer, s.trust_remote_code)
    corpus = prepared_corpus(s.data)  # raw text is checked to fit in memory
    if corpus is not None:  # read lazily, with the splits kha tokenize set aside
        corpus.check_tokenizer(tokenizer)
        train, validation, heldout = (
            corpus.blocks(split, s.seq_len, None if split == "train" else s.eval_blocks) for split in SPLITS
        )
    else:
        train, validation, heldout = train_validation_heldout_split(
            read_documents(s.data), tokenizer, s.seq_len, max_eval_blocks=s.eval_blocks
        )
    other = other_domain_blocks(tokenizer, s.seq_len, s.eval_blocks)
    print(
        f"data: {len(train)} train / {len(validation)} validation / {len(heldout)} held-out blocks of {s.seq_len} "
        f"tokens; other domain: {len(other)} blocks of {OTHER_DOMAIN}"
    )
    s.extra["data"] = {
        "train_blocks": len(train),
        "validation_blocks": len(validation),
        "heldout_blocks": len(heldout),
        "other_domain_blocks": len(other),
        "other_domain": OTHER_DOMAIN,
    }
    targets, rank = lora_targets(s.knock), None
    if "lora-matched" in s.arms:
        rank = _match_lora(s, base_dir, kha_dir, targets)
    return _Prepared(base_dir, kha_dir, tokenizer, train, validation, heldout, other, targets, rank, s.knock)


def with_knock_adapter(model: nn.Module, knock: str) -> nn.Module:
    """MODEL (a stock model) wrapped by PEFT with kha-hf's knock adapter of preset KNOCK (`KnockConfig`)."""
    from ..peft import KnockConfig
    from ..training.modes import wrap_with_peft

    return wrap_with_peft(model, KnockConfig(knock=knock))


def _match_lora(s: ContinuedAB, base_dir: Path, kha_dir: Path | None, targets: list[str]) -> int:
    """The LoRA control's rank: its parameter count on TARGETS closest to the knocks' (counted on the conversion,
    or on the stock model with the knock adapter when no KHA arm runs)."""
    from transformers import AutoModelForCausalLM

    from ..modeling.modeling_kha import KHAForCausalLM

    if kha_dir is not None:
        probe = KHAForCausalLM.from_pretrained(kha_dir, dtype=torch.float32)
        knocks = count_knock_parameters(probe)
    else:

        def stock():
            return AutoModelForCausalLM.from_pretrained(
                base_dir, dtype=torch.float32, trust_remote_code=s.trust_remote_code
            )

        adapted = with_knock_adapter(stock(), s.knock)
        knocks = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
        del adapted
        probe = stock()  # its projections unwrapped, as the LoRA will see them
    rank, lora = matched_lora_rank(probe, targets, knocks)
    del probe
    off = (lora - knocks) / knocks
    s.extra["parameter_matching"] = {
        "knock_parameters": knocks,
        "lora_rank": rank,
        "lora_targets": targets,
        "lora_parameters": lora,
        "relative_difference": off,
        "exact": lora == knocks,
    }
    print(
        f"trainable parameters: knocks {knocks:,}; LoRA r={rank} on {', '.join(targets)}: {lora:,} "
        + ("(exact match)" if lora == knocks else f"({off:+.1%}: no rank matches exactly; the closest is used)")
    )
    return rank


def _build(arm: str, run_seed: int, p: _Prepared, trust_remote_code: bool) -> nn.Module:
    from transformers import AutoModelForCausalLM

    from ..modeling.modeling_kha import KHAForCausalLM
    from ..training.modes import prepare_for_mode, with_ia3, with_lora, with_shared_oft

    torch.manual_seed(run_seed)  # the LoRA A matrices are random (the other adapters start as the identity)
    if arm in KHA_ARMS:
        model = KHAForCausalLM.from_pretrained(p.kha_dir, dtype=torch.float32)
        return prepare_for_mode(model, "full" if arm == "kha-full" else "knocks")
    model = AutoModelForCausalLM.from_pretrained(p.base_dir, dtype=torch.float32, trust_remote_code=trust_remote_code)
    if arm == "base-full":
        return model.requires_grad_(True)
    if arm == "knock-adapter":
        return with_knock_adapter(model, p.knock)
    if arm == "ia3":
        return with_ia3(model)
    if arm == "oft":
        return with_shared_oft(model)
    return with_lora(model, p.targets, p.rank)


def _train_and_measure(s: ContinuedAB, p: _Prepared, arm: str, run_seed: int, lr: float, output: Path) -> ArmRun:
    """One arm at one seed and rate: trained, then its per-block losses on validation, held-out and other-domain
    (or the same run's numbers from --run-cache, unless its model is evaluated afterwards)."""
    keep_model = s.run_eval and run_seed == s.seed
    if p.cache is not None and not keep_model:
        stored = p.cache.get(arm, run_seed, lr, (len(p.heldout), len(p.other)))
        if stored is not None:
            print(f"run cache: {arm} seed {run_seed} lr {lr:g} reused from {p.cache.path(arm, run_seed, lr)}")
            return stored
    model = _build(arm, run_seed, p, s.trust_remote_code)
    trainable = sum(x.numel() for x in model.parameters() if x.requires_grad)
    total = sum(x.numel() for x in model.parameters())  # the network this arm runs (adapter weights included)
    if trainable == 0:
        raise KHAError(f"the {arm} arm has no trainable parameters on this model: drop it from --arms")
    run = train_arm(
        model, arm, run_seed, output / "runs" / arm, p.train, p.validation, s.max_steps, s.batch_size, lr,
        measure_before=False, disable_tqdm=True, weight_decay=0.1 if arm.endswith("-full") else 0.0,
    )  # fmt: skip
    run.trainable_parameters = trainable
    run.lr = lr
    run.validation_loss = run.heldout_loss  # train_arm evaluated on the validation split
    run.heldout_blocks = block_losses(model, p.heldout, s.batch_size)
    run.other_blocks = block_losses(model, p.other, s.batch_size)
    run.heldout_loss = sum(run.heldout_blocks) / len(run.heldout_blocks)
    tokens = s.max_steps * s.batch_size * s.seq_len
    # training FLOPs, estimated: forward 2N and backward 2N per token through the whole network, plus 2 per
    # trainable parameter and token for the weight gradients (6N for full training)
    run.flops = (4 * total + 2 * trainable) * tokens
    run.model = model if keep_model else None
    if p.cache is not None:
        p.cache.put(run)
    return run


def _run(s: ContinuedAB, output: Path, cache_dir: Path | None = None) -> dict:
    p = _prepare(s, output)
    before, placements = {}, {}
    for arm in s.arms:  # each arm as it starts (every adapter should compute what its base computes)
        model = _build(arm, s.seed, p, s.trust_remote_code)
        before[arm] = {
            "heldout": block_losses(model, p.heldout, s.batch_size),
            "other": block_losses(model, p.other, s.batch_size),
        }
        placements[arm] = _adapted_modules(model)
        del model
    if cache_dir is not None:  # keyed by each arm's losses before training: they pin its starting weights
        p.cache = _run_cache(s, p, cache_dir, before)
    s.extra["adapted_modules"] = {arm: names for arm, names in placements.items() if names}

    # 1. each arm's rate, chosen on the validation split at the first seed
    tuning: dict[str, list[dict]] = {}
    chosen: dict[str, ArmRun] = {}
    for arm in s.arms:
        rates = list(s.grid(arm))
        while rates:
            lr = rates.pop(0)
            run = _train_and_measure(s, p, arm, s.seed, lr, output)
            tuning.setdefault(arm, []).append({"lr": lr, "validation_loss": run.validation_loss})
            print(f"tuning {arm:>12} lr {lr:g}: validation loss {run.validation_loss:.4f}")
            if arm not in chosen or _loss(run.validation_loss) < _loss(chosen[arm].validation_loss):
                chosen[arm] = run
            if not rates and len(tuning[arm]) < len(s.grid(arm)) + s.grid_extensions:
                rates = _beyond_the_edge(tuning[arm], chosen[arm].lr)
    diverged = [arm for arm, run in chosen.items() if _loss(run.validation_loss) == float("inf")]
    if diverged:
        raise KHAError(
            f"every rate tried for {', '.join(diverged)} diverged (validation loss NaN or infinite): try lower rates "
            "(--lr-grid, --lr-grid-full)"
        )
    best = {arm: run.lr for arm, run in chosen.items()}
    print("chosen learning rates (validation split): " + ", ".join(f"{a} {lr:g}" for a, lr in best.items()))

    # 2. every arm at its rate, over the seeds (the first seed's runs are the tuning runs at the chosen rate)
    runs: list[ArmRun] = list(chosen.values())
    for run_seed in range(s.seed + 1, s.seed + s.seeds):
        for arm in s.arms:
            run = _train_and_measure(s, p, arm, run_seed, best[arm], output)
            runs.append(run)
            print(
                f"seed {run_seed} {arm:>12}: held-out {run.heldout_loss:.4f}, other domain "
                f"{sum(run.other_blocks) / len(run.other_blocks):.4f} ({run.wall_seconds:.0f} s)"
            )

    summary = {
        "model": str(s.model),
        "knock": s.knock,
        "steps": s.max_steps,
        "seq_len": s.seq_len,
        "batch_size": s.batch_size,
        "training_tokens_per_run": s.max_steps * s.batch_size * s.seq_len,
        "seeds": list(range(s.seed, s.seed + s.seeds)),
        "varies_per_seed": "the data order (which training blocks form each batch and their order) and the LoRA's "
        "random initialisation; every arm starts from the same pretrained weights",
        "lr_grids": {"full": list(s.lr_grid_full), "adapters": list(s.lr_grid_small)},
        "tuning": tuning,
        "chosen_lr": best,
        "grid_extensions": s.grid_extensions,
        "at_grid_edge": {arm: _at_edge(tuning[arm], lr) for arm, lr in best.items()},
        **s.extra,
        "arms": arm_table(runs, before, s.arms),
        "comparisons": [compare(runs, arm, control) for arm, control in comparisons(s.arms)],
        **({"runs_reused_from_cache": p.cache.reused} if p.cache is not None and p.cache.reused else {}),
    }
    write_curves_csv(runs, output / "loss_curves.csv")
    plot_mean_curves(runs, output / "loss_curves.png", f"continued training from {Path(str(s.model)).name}")
    print_report(summary)
    if s.run_eval:
        summary["eval"] = evaluate_arms(
            {r.arm: r.model for r in runs if r.model is not None}, p.tokenizer, s.limit, output
        )
    return summary


def _run_cache(s: ContinuedAB, p: _Prepared, folder: Path, before: dict) -> RunCache:
    """The --run-cache of this A/B: what decides a run's numbers besides its arm, seed and rate (cache.py)."""
    common = {
        "blocks": blocks_digest(p.train, p.validation, p.heldout, p.other),
        "knock": s.knock,
        "steps": [s.max_steps, s.seq_len, s.batch_size],
    }
    per_arm = {
        arm: {"before": before[arm], **({"lora": [p.rank, p.targets]} if arm == "lora-matched" else {})}
        for arm in s.arms
    }
    return RunCache(folder, common, per_arm, s.max_steps)


def _adapted_modules(model: nn.Module) -> list[str]:
    """The kinds of module a PEFT adapter wraps in MODEL (e.g. ["k_proj", "v_proj"]); [] for a model without one."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, BaseTunerLayer)})


def _loss(value: float) -> float:
    """A validation loss for comparison: a diverged run (NaN) loses to every finite one."""
    return value if value == value else float("inf")


def _at_edge(tried: list[dict], best: float) -> bool:
    """True if BEST is the lowest or highest of two or more rates TRIED (after any extensions)."""
    return bool(_beyond_the_edge(tried, best))


def _beyond_the_edge(tried: list[dict], best: float) -> list[float]:
    """The next rate to try when BEST is the lowest or highest rate TRIED (the grid may not hold the arm's best
    rate): one step further out, the step being the ratio between the two outermost rates on that side."""
    rates = sorted({t["lr"] for t in tried})
    if len(rates) < 2 or rates[0] < best < rates[-1]:
        return []
    if best == rates[-1]:
        return [rates[-1] * rates[-1] / rates[-2]]
    return [rates[0] * rates[0] / rates[1]]
