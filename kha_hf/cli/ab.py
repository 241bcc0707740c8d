"""`kha ab [PRESET]`: a baseline against its KHA twin, from scratch or with --from MODEL (kha_hf.ab)."""

from __future__ import annotations

from ..ab.options import (
    ADAPTER_ARMS,
    ARMS,
    DEFAULT_ARMS,
    EVAL_LIMIT,
    GRID_EXTENSIONS,
    LR_GRID_FULL,
    LR_GRID_SMALL,
    arm_list,
    variant_list,
)
from ..ab.variants import PAPER_ABLATION
from ..modeling.configuration_kha import DEFAULT_KNOCK, KNOCK_PRESETS
from ..training.spikes import SPIKE_MARGIN
from ._common import (
    MAX_BATCH,
    MAX_SEQ_LEN,
    MAX_STEPS,
    add_schedule_arguments,
    bounded_int,
    non_negative_float,
    positive_float,
    positive_int,
    rate_list,
    seed_int,
)


def add_parser(sub) -> None:
    from ..training.presets import PRESETS

    p = sub.add_parser(
        "ab",
        help="train a baseline and its KHA twin from scratch (same seed, data, steps) and compare losses",
        description="From-scratch A/B: a baseline and its KHA twin (same initial weights plus identity knocks) "
        "train with the same seed, data order, steps and the paper's optimiser. Writes loss_curves.csv, "
        "loss_curves.png and summary.json; prints per-seed held-out losses and the mean paired delta with a "
        "95 % t-interval over seeds. "
        f"Presets: {', '.join(PRESETS)} (cpu-tiny, 3 seeds: 13 minutes measured on 2 CPU cores, 5 about 21)."
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
    )
    p.add_argument(
        "base",
        nargs="?",
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
    p.add_argument(
        "--max-eval-blocks",
        type=bounded_int(MAX_STEPS),
        help="held-out (and validation) blocks evaluated per run (default: raw text's all, a prepared corpus's 256)",
    )
    add_schedule_arguments(p)
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
        type=bounded_int(10, zero=True),
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


def run(args) -> None:
    from ..ab.command import run as run_ab

    run_ab(args)
