"""`kha eval`'s one entry from the command line: a comparison (`compare.run_eval`) or `--recompute DIR`
(`paired.recompute`), apart; an option of a comparison given with --recompute is refused, not ignored."""

from __future__ import annotations

from ..common.errors import KHAError
from .compare import run_eval

# What --recompute never uses (it reads DIR alone): given with it (not its parser default, which `cli/eval.py`
# writes here), refused instead of silently ignored.
RECOMPUTE_IGNORES: dict = dict.fromkeys(
    "baseline candidate adapter tasks suite limit num_fewshot batch_size device dtype output overwrite local_data "
    "perplexity seed trust_remote_code backend vllm_python vllm_args".split()
)
# A comparison takes exactly these options: `run_eval`'s parameters, two of them under another name.
RUN_EVAL_NAMES = {"perplexity": "perplexity_file", "vllm_args": "vllm_model_args"}


def run(args) -> int:
    if args.recompute:
        given = [dest for dest, default in RECOMPUTE_IGNORES.items() if getattr(args, dest, default) != default]
        if given:
            options = ", ".join("--" + dest.replace("_", "-") for dest in given)
            raise KHAError(f"--recompute DIR reads DIR alone; it cannot be combined with {options}")
        return _recompute(args.recompute)
    if not args.candidate and not args.adapter:
        raise KHAError("--candidate is required (or --baseline with --adapter, or --recompute DIR)")
    run_eval(**{RUN_EVAL_NAMES.get(dest, dest): getattr(args, dest) for dest in RECOMPUTE_IGNORES})
    return 0


def _recompute(folder: str) -> int:
    from ..eval.paired import recompute

    result = recompute(folder)
    for row in result["rows"]:
        paired = row["paired"]
        interval = paired["ci95"]
        shown = f"[{interval[0]:+.4f}, {interval[1]:+.4f}]" if interval else "[–]"
        print(
            f"{row['task']} {row['metric']}: Δ {paired['delta']:+.4f} {shown}, p {paired['p_value']}, "
            f"Holm p {paired['p_holm']} ({paired['n']} documents, {paired['test']})"
        )
    if result["matches"]:
        print(f"every paired statistic equals {folder}/summary.json")
        return 0
    print(f"differs from {folder}/summary.json: {', '.join(result['mismatches'])}")
    return 1
