"""`kha ab [PRESET]`: from-scratch baseline vs KHA twin (kha_hf.training.ab)."""

from __future__ import annotations

from ..modeling.configuration_kha import DEFAULT_KNOCK, KNOCK_PRESETS
from ..training.ab_variants import PAPER_ABLATION
from ..training.spikes import SPIKE_MARGIN
from ._common import (
    MAX_BATCH,
    MAX_SEQ_LEN,
    MAX_STEPS,
    HelpFormatter,
    bounded_int,
    non_negative_float,
    positive_float,
    positive_int,
    rate_list,
    seed_int,
)

LR_GRID_FULL = (2e-5, 5e-5, 1.5e-4)  # = kha_hf.workflows.continued_ab's (not imported: `kha ab --help` stays light)
LR_GRID_SMALL = (1e-3, 3e-3, 1e-2)
ARMS = ("base-full", "kha-full", "kha-knocks", "lora-matched", "knock-adapter", "ia3", "oft")  # = the workflow's
DEFAULT_ARMS = ARMS[:4]
ADAPTER_ARMS = ("knock-adapter", "lora-matched", "ia3", "oft")
GRID_EXTENSIONS = 2  # = the workflow's
EVAL_LIMIT = 100


def extension_count(text) -> int:
    """argparse type: an integer from 0 to 10 (--grid-extensions)."""
    import argparse

    from ._common import _number

    value = _number(text, int, 0, True, "an integer")
    if value > 10:
        raise argparse.ArgumentTypeError(f"must be at most 10, got {text}")
    return value


def arm_list(text) -> list[str]:
    """argparse type: comma-separated arm names, or 'adapters' (ADAPTER_ARMS)."""
    import argparse

    if isinstance(text, (list, tuple)):
        return list(text)
    names = [part.strip() for part in str(text).split(",") if part.strip()]
    if names == ["adapters"]:
        return list(ADAPTER_ARMS)
    if "adapters" in names:
        raise argparse.ArgumentTypeError(f"{text!r}: 'adapters' stands alone (it means {','.join(ADAPTER_ARMS)})")
    unknown = [name for name in names if name not in ARMS]
    if not names or unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give distinct arms from {', '.join(ARMS)}, or 'adapters'"
            + (f" ({', '.join(unknown)} unknown)" if unknown else "")
        )
    return names


def variant_list(text) -> list[str]:
    """argparse type: comma-separated ablation variants (knock presets, each optionally `_random`)."""
    import argparse

    from ..training.ab_variants import parse_variants

    try:
        return [v.name for v in parse_variants(text)]
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def add_parser(sub) -> None:
    from ..training.ab_presets import AB_PRESETS

    p = sub.add_parser(
        "ab",
        help="train a baseline and its KHA twin from scratch (same seed, data, steps) and compare losses",
        description="From-scratch A/B: a baseline and its KHA twin (same initial weights plus identity knocks) "
        "train with the same seed, data order, steps and the paper's optimiser. Writes loss_curves.csv, "
        "loss_curves.png and summary.json; prints per-seed held-out losses and the mean paired delta with a "
        "95 % t-interval over seeds. "
        f"Presets: {', '.join(AB_PRESETS)} (cpu-tiny, 3 seeds: 13 minutes measured on 2 CPU cores, 5 about 21)."
        "\n\n"
        "With --from MODEL: continued training from a real checkpoint, four arms by default (base full / KHA full / "
        "KHA knocks / a LoRA control of the knocks' size); --arms adapters instead compares the knocks as a PEFT "
        "adapter on the stock model with PEFT's LoRA (their size), IA3 and OFT (shared blocks on o_proj). Each "
        "arm's learning rate is chosen from a grid (--lr-grid-full, --lr-grid) by its loss on a validation split "
        "that the reported held-out split never touches; then each "
        "arm trains at its rate over the seeds; held-out loss on the corpus and on Wikipedia text (forgetting), "
        "paired intervals over seeds and blocks. SmolLM2-135M defaults (24 steps x 4 x 128 tokens, grids of 3, 5 "
        "seeds): 32 minutes measured on 2 CPU cores (52 with other work running).",
        epilog="examples:\n  kha ab                                   # cpu-tiny, mlp_v, embedded Shakespeare\n"
        "  kha ab gpu-small --knock linear_qkv --bf16\n  kha ab ./my_config.json --max-steps 2000 --data ./corpus/\n"
        "  kha ab --from ./smollm2.gguf --seeds 3          # continued training: should I convert first?\n"
        "  kha ab --from ./smollm2.gguf --arms adapters    # knock adapter vs LoRA, IA3, OFT\n"
        "  kha ab gpu-small --from Qwen/Qwen3-0.6B --eval  # on a GPU: 2000 steps x 16 x 1024 tokens",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "base",
        nargs="?",
        default=None,
        metavar="BASE_CONFIG_OR_PRESET",
        help="a preset, or a config file/folder (default: cpu-tiny); with --from, a preset sets steps, sequence "
        "length and batch size",
    )
    p.add_argument("--knock", default=DEFAULT_KNOCK, choices=sorted(KNOCK_PRESETS), help="knock preset of the twin")
    p.add_argument(
        "--variants",
        type=variant_list,
        metavar="V1,V2,...",
        help="the paper's ablation in one run: one baseline and a twin per variant (knock presets, each optionally "
        f"with _random: random knock initialisation), same weights, data order and seeds; e.g. {PAPER_ABLATION}",
    )
    p.add_argument(
        "--save-models",
        action="store_true",
        help="keep every trained model in OUTPUT/models/ARM-seedN (with the tokenizer), for kha eval",
    )
    p.add_argument(
        "--logit-every",
        type=bounded_int(MAX_STEPS),
        metavar="K",
        help="measure each layer's largest attention logit every K steps (default: 50 times per run)",
    )
    p.add_argument(
        "--spike-margin",
        type=positive_float,
        default=SPIKE_MARGIN,
        help="a loss spike: a step's loss above (1 + margin) x the median of the previous 100 steps (default: "
        "%(default)s)",
    )
    p.add_argument("--output", default="kha-ab", help="new folder for loss_curves.csv/.png and summary.json")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output folder of kha results")
    p.add_argument("--max-steps", type=bounded_int(MAX_STEPS), help="optimizer steps (default: the preset's)")
    p.add_argument("--seq-len", type=bounded_int(MAX_SEQ_LEN), help="tokens per block (default: the preset's)")
    p.add_argument("--batch-size", type=bounded_int(MAX_BATCH), help="blocks per step (default: the preset's)")
    p.add_argument(
        "--lr", type=non_negative_float, help="peak learning rate (default: the preset's; with --from: knocks and LoRA)"
    )
    p.add_argument("--data", nargs="*", default=None, help="training text (default: embedded Shakespeare)")
    p.add_argument("--seed", type=seed_int, default=0, help="first seed (model init and data order); seeds run from it")
    p.add_argument(
        "--seeds", type=bounded_int(1000), default=5, help="how many seeds: a 95 %% interval needs 2 or more"
    )
    p.add_argument("--bf16", action="store_true", help="train in bfloat16 mixed precision")
    cont = p.add_argument_group("continued training from a real checkpoint (--from)")
    cont.add_argument(
        "--from",
        dest="from_model",
        metavar="MODEL",
        help="convert MODEL (folder, Hub id or .gguf) and compare base vs KHA full training, and KHA knocks vs a "
        "LoRA of their size, each at its own tuned learning rate (defaults then: 24 steps, seq 128, batch 4)",
    )
    cont.add_argument(
        "--lr-grid-full",
        type=rate_list,
        default=",".join(f"{lr:g}" for lr in LR_GRID_FULL),
        help="learning rates tried for the full-training arms (comma-separated; one value: no tuning)",
    )
    cont.add_argument(
        "--lr-grid",
        type=rate_list,
        default=",".join(f"{lr:g}" for lr in LR_GRID_SMALL),
        help="learning rates tried for every adapter arm: knocks, LoRA, IA3, OFT (comma-separated; one value: no "
        "tuning)",
    )
    cont.add_argument(
        "--grid-extensions",
        type=extension_count,
        default=GRID_EXTENSIONS,
        help="when an arm's best rate is the lowest or highest of its grid, try up to this many rates beyond that "
        "edge, one grid step at a time (0: the grid only)",
    )
    cont.add_argument(
        "--arms",
        type=arm_list,
        default=",".join(DEFAULT_ARMS),
        help=f"comma-separated arms from {', '.join(ARMS)}, or 'adapters' for {', '.join(ADAPTER_ARMS)} "
        "(the knock adapter against PEFT's LoRA, IA3 and OFT on the stock model) (default: %(default)s)",
    )
    cont.add_argument("--eval", action="store_true", help="also run the quick lm-eval suite (paired statistics)")
    cont.add_argument("--limit", type=positive_int, default=EVAL_LIMIT, help="documents per eval task (--eval)")
    cont.add_argument("--tokenizer", metavar="NAME_OR_PATH", help="tokenizer to use when MODEL has none")
    cont.add_argument(
        "--trust-remote-code", action="store_true", help="run model code shipped inside MODEL (never by default)"
    )
    cont.add_argument(
        "--run-cache",
        metavar="DIR",
        help="keep each finished run's numbers in DIR; started again with the same DIR and settings, a stopped A/B "
        "reuses them and continues where it stopped",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from ..common.errors import KHAError
    from ._common import MAX_SEED

    if args.seed + args.seeds - 1 > MAX_SEED:
        raise KHAError(f"--seed {args.seed} with --seeds {args.seeds} runs past the largest seed, {MAX_SEED}")
    # options of one mode, given in the other: refused rather than silently ignored
    continued_only = {
        "--arms": args.arms != list(DEFAULT_ARMS),
        "--lr-grid": args.lr_grid != list(LR_GRID_SMALL),
        "--lr-grid-full": args.lr_grid_full != list(LR_GRID_FULL),
        "--grid-extensions": args.grid_extensions != GRID_EXTENSIONS,
        "--eval": args.eval,
        "--limit": args.limit != EVAL_LIMIT,
        "--tokenizer": args.tokenizer is not None,
        "--trust-remote-code": args.trust_remote_code,
        "--run-cache": args.run_cache is not None,
    }
    scratch_only = {  # options of the from-scratch A/B, refused with --from rather than ignored
        "--variants": args.variants is not None,
        "--logit-every": args.logit_every is not None,
        "--spike-margin": args.spike_margin != SPIKE_MARGIN,
        "--save-models": args.save_models,
    }
    if args.variants is not None and args.knock != DEFAULT_KNOCK:
        raise KHAError("--variants names every twin: leave --knock out (or add its preset to --variants)")
    if args.from_model:
        given = [flag for flag, set_ in scratch_only.items() if set_]
        if given:
            raise KHAError(
                f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to from-scratch runs only, not --from"
            )
        if args.bf16:
            raise KHAError("--bf16 is not used with --from (continued training runs in float32)")
        return _run_continued(args)
    given = [flag for flag, set_ in continued_only.items() if set_]
    if given:
        raise KHAError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only with --from MODEL")
    from ..training.ab import ab

    ab(
        args.base or "cpu-tiny",
        knock=args.knock,
        output=args.output,
        max_steps=args.max_steps,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        lr=args.lr,
        data=args.data,
        seed=args.seed,
        seeds=args.seeds,
        bf16=args.bf16,
        overwrite=args.overwrite,
        variants=args.variants,
        logit_every=args.logit_every,
        spike_margin=args.spike_margin,
        save_models=args.save_models,
    )
    return 0


def _run_continued(args) -> int:
    from ..common.errors import KHAError
    from ..training.ab_presets import AB_PRESETS
    from ..workflows.continued_ab import ContinuedAB, continued_ab

    defaults = {"max_steps": 24, "seq_len": 128, "batch_size": 4}  # SmolLM2: 32 minutes measured on 2 CPU cores
    if args.base is not None:  # a preset sets the run's size (the model is MODEL's)
        if args.base not in AB_PRESETS:
            raise KHAError(f"with --from, the positional argument is a preset ({', '.join(AB_PRESETS)}), not a config")
        preset = AB_PRESETS[args.base]
        defaults.update(max_steps=preset.max_steps, seq_len=preset.seq_len, batch_size=preset.batch_size)
    if args.lr is not None:
        raise KHAError("with --from, set the knocks' and the LoRA's learning rates with --lr-grid (one value: fixed)")
    given = {k: getattr(args, k) for k in defaults if getattr(args, k) is not None}
    settings = ContinuedAB(
        args.from_model,
        knock=args.knock,
        arms=tuple(args.arms),
        grid_extensions=args.grid_extensions,
        lr_grid_full=tuple(args.lr_grid_full),
        lr_grid_small=tuple(args.lr_grid),
        data=args.data,
        seed=args.seed,
        seeds=args.seeds,
        run_eval=args.eval,
        limit=args.limit,
        tokenizer=args.tokenizer,
        trust_remote_code=args.trust_remote_code,
        run_cache=args.run_cache,
        **{**defaults, **given},
    )
    output = args.output if args.output != "kha-ab" else "kha-ab-continued"
    continued_ab(settings, output=output, overwrite=args.overwrite)
    return 0
