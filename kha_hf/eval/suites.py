"""Named task lists for `kha eval --suite`."""

from __future__ import annotations

from ..common.errors import KHAError

SUITES: dict[str, list[str]] = {
    # English benchmarks of the paper that lm-eval provides (code tasks left out: they execute model output)
    "paper": (
        "mmlu mmlu_pro arc_easy arc_challenge hellaswag piqa commonsense_qa race gsm8k minerva_math gpqa_main_zeroshot"
    ).split(),
    # a few cheap multiple-choice tasks (all have offline copies)
    "quick": ["arc_easy", "piqa", "copa", "winogrande"],
}
# Paper benchmarks outside `paper`: CMMLU (lm-eval: cmmlu), C-Eval (ceval-valid) and AGIEval (agieval) are
# Chinese or mixed; HumanEval / MBPP (humaneval, mbpp) run model-written code and need lm-eval's
# --confirm_run_unsafe_code; CMATH has no lm-eval task.


def resolve_tasks(tasks: list[str] | None, suite: str | None) -> list[str]:
    if tasks and suite:
        raise KHAError("pass --tasks or --suite, not both")
    if tasks:  # lm-eval style `a,b` as well as separate arguments
        names = [name.strip() for item in tasks for name in item.split(",") if name.strip()]
        if not names:
            raise KHAError("--tasks names no task")
        return list(dict.fromkeys(names))
    suite = suite or "quick"
    if suite not in SUITES:
        raise KHAError(f"unknown suite {suite!r}; choose one of: {', '.join(SUITES)}")
    return list(SUITES[suite])
