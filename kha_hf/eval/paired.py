"""The paired comparison of two lm-eval runs on the same documents: rows, Holm's correction, the audit trail.

- Documents are paired on (task, subtask, doc_id) and must carry the same lm-eval `doc_hash` in both runs: the same
  ids over different documents (another dataset revision, another split) are an error, not a silent mismatch.
- Every paired p-value of one comparison is one family: each row reports its raw p and its Holm-adjusted p, and
  marks what survives the correction at 0.05. No metric is exempt (none is declared primary).
- lm-eval logs a log-likelihood task's per-document value under the name of its aggregate ("perplexity" for
  lambada): the per-document value is the log-likelihood (higher is better), the aggregate is exp(−mean), lower is
  better. Such rows say so, so a positive Δ next to a lower perplexity reads the right way.
- `per_document.jsonl` holds every paired score (task, metric, subtask, doc_id, doc_hash, baseline, candidate);
  `recompute` reproduces every Δ, interval and p (raw and Holm) from it alone (`kha eval --recompute DIR`).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..common.errors import KHAError
from ..common.statistics import holm, paired_difference

PER_DOCUMENT_FILE = "per_document.jsonl"
LOGLIKELIHOOD_METRICS = {"perplexity"}  # per-document values are log-likelihoods (see the module docstring)
PAIRED_FIELDS = ("delta", "stderr", "ci95", "p_value", "n", "excluded", "discordant", "test")


def per_document_scores(samples: dict, groups: dict[str, list[str]]) -> dict[tuple[str, str], dict]:
    """lm-eval's logged samples -> (task, metric) -> {(subtask, doc_id): (score, doc_hash)}; group members (the
    MMLU subjects) are pooled under their group, so the group is paired over all its documents."""
    group_of = {sub: group for group, subs in groups.items() for sub in subs}
    scores: dict[tuple[str, str], dict] = {}
    for task, task_samples in samples.items():
        for sample in task_samples:
            filt = sample.get("filter", "none")
            for metric in sample.get("metrics", []):
                value = sample.get(metric)
                if not isinstance(value, (int, float)):
                    continue  # tuples (word/byte perplexity), strings
                name = metric if filt == "none" else f"{metric} ({filt})"
                key = (group_of.get(task, task), name)
                scores.setdefault(key, {})[(task, sample["doc_id"])] = (float(value), sample.get("doc_hash"))
    return scores


def pair(baseline: dict, candidate: dict, key: tuple[str, str]) -> tuple[list, list, list]:
    """(document keys, baseline scores, candidate scores) over the documents both runs scored; KHAError when the
    runs scored different documents (ids missing on one side, or the same ids with different doc_hash)."""
    common = sorted(baseline.keys() & candidate.keys())
    if len(common) != len(baseline) or len(common) != len(candidate):
        raise KHAError(
            f"{key[0]} {key[1]}: the two models were scored on different documents ({len(baseline)} and "
            f"{len(candidate)} scored, {len(common)} in common); rerun both with the same settings"
        )
    if differ := [k for k in common if baseline[k][1] != candidate[k][1]]:
        raise KHAError(
            f"{key[0]} {key[1]}: {len(differ)} of {len(common)} document ids hold different documents in the two "
            f"runs (lm-eval doc_hash differs, e.g. {differ[0][0]} doc {differ[0][1]}): another dataset revision or "
            "split; rerun both with the same data"
        )
    return common, [baseline[k][0] for k in common], [candidate[k][0] for k in common]


def paired_stats(baseline_scores: list[float], candidate_scores: list[float]) -> dict:
    stats = paired_difference(baseline_scores, candidate_scores)
    return {k: stats[k] for k in PAIRED_FIELDS if k in stats}


def comparison_rows(baseline, candidate) -> list[dict]:
    """One row per (task, metric) of CANDIDATE (a ModelResult): each model's value ± stderr and, with a BASELINE,
    the paired difference with raw and Holm-adjusted p."""
    rows = []
    for key in sorted(candidate.metrics):
        value_c, se_c = candidate.metrics[key]
        row = {"task": key[0], "metric": key[1], "candidate": value_c, "candidate_stderr": se_c}
        if baseline is not None and key in baseline.metrics:
            value_b, se_b = baseline.metrics[key]
            row.update(baseline=value_b, baseline_stderr=se_b, delta=value_c - value_b)
            docs_b, docs_c = baseline.per_doc.get(key, {}), candidate.per_doc.get(key, {})
            if docs_b or docs_c:
                _, b, c = pair(docs_b, docs_c, key)
                row["paired"] = paired_stats(b, c)
                if key[1].split(" ")[0] in LOGLIKELIHOOD_METRICS:
                    row["paired_unit"] = "log-likelihood per document (higher is better)"
        rows.append(row)
    return add_holm(rows)


def add_holm(rows: list[dict]) -> list[dict]:
    """Holm-adjusted p over every paired row (one family), and whether each survives at 0.05."""
    paired = [r for r in rows if "paired" in r]
    for row, adjusted in zip(paired, holm([r["paired"]["p_value"] for r in paired]), strict=True):
        row["paired"]["p_holm"] = adjusted
        row["significant"] = adjusted is not None and adjusted < 0.05
    return rows


def per_document_records(baseline, candidate) -> list[dict]:
    """Every paired score of the comparison, one record per (task, metric, document)."""
    records = []
    for key in sorted(candidate.per_doc):
        if key not in baseline.per_doc:
            continue
        common, b, c = pair(baseline.per_doc[key], candidate.per_doc[key], key)
        for (subtask, doc_id), score_b, score_c in zip(common, b, c, strict=True):
            records.append(
                {
                    "task": key[0],
                    "metric": key[1],
                    "subtask": subtask,
                    "doc_id": doc_id,
                    "doc_hash": candidate.per_doc[key][(subtask, doc_id)][1],
                    "baseline": score_b,
                    "candidate": score_c,
                }
            )
    return records


def write_per_document(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")


def recompute(folder: str | Path) -> dict:
    """Every paired Δ, interval and p (raw and Holm) of a `kha eval` folder, from its per_document.jsonl alone, and
    whether each equals what summary.json reports: {"rows": [...], "matches": bool, "mismatches": [...]}.

    Both files are checked as untrusted input (types, sizes, nesting): a bad one is a KHAError naming it. A folder
    without summary.json, or without a single paired score, has nothing to compare: also a KHAError, never a pass.
    """
    folder = Path(folder)
    path = folder / PER_DOCUMENT_FILE
    if not path.is_file():
        raise KHAError(f"{folder} has no {PER_DOCUMENT_FILE}: not a kha eval folder with a baseline")
    summary_path = folder / "summary.json"
    if not summary_path.is_file():
        raise KHAError(f"{folder} has no summary.json: nothing to compare the recomputed statistics with")
    reported = _reported_paired(summary_path)
    grouped: dict[tuple[str, str], tuple[list, list]] = {}
    for n, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        task, metric, baseline, candidate = _per_document_record(_load_json(line, f"{path}:{n}"), f"{path}:{n}")
        b, c = grouped.setdefault((task, metric), ([], []))
        b.append(baseline)
        c.append(candidate)
    if not grouped:
        raise KHAError(f"{path} holds no paired scores: nothing to compare")
    rows = add_holm([{"task": t, "metric": m, "paired": paired_stats(b, c)} for (t, m), (b, c) in grouped.items()])
    mismatches = []
    for row in rows:
        expected = reported.get((row["task"], row["metric"]))
        if expected is None or json.dumps(expected, sort_keys=True) != json.dumps(row["paired"], sort_keys=True):
            mismatches.append(f"{row['task']} {row['metric']}")
    recomputed = {(row["task"], row["metric"]) for row in rows}
    mismatches += [f"{t} {m} (in summary.json only)" for t, m in sorted(reported.keys() - recomputed)]
    return {"rows": rows, "matches": not mismatches, "mismatches": mismatches}


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise KHAError(f"{path} is not UTF-8 text ({err})") from err


def _load_json(text: str, where: str):
    try:
        return json.loads(text)
    except ValueError as err:  # also a number of more than 4,300 digits
        raise KHAError(f"{where}: not valid JSON ({str(err).splitlines()[0]})") from err
    except RecursionError:
        raise KHAError(f"{where}: JSON nested too deeply") from None


def _per_document_record(record, where: str) -> tuple[str, str, float, float]:
    """(task, metric, baseline score, candidate score) of one per_document.jsonl line, or a KHAError."""
    if not isinstance(record, dict):
        raise KHAError(f"{where}: not a per-document record (a JSON object with task, metric, baseline, candidate)")
    for field in ("task", "metric"):
        if not isinstance(record.get(field), str):
            raise KHAError(f"{where}: {field} must be a string, got {type(record.get(field)).__name__}")
    scores = []
    for field in ("baseline", "candidate"):
        value = record.get(field)
        if type(value) not in (int, float):
            raise KHAError(f"{where}: {field} must be a number, got {type(value).__name__}")
        try:
            scores.append(float(value))
        except OverflowError:
            raise KHAError(f"{where}: {field} is too large to be a score") from None
    return record["task"], record["metric"], scores[0], scores[1]


def _reported_paired(summary_path: Path) -> dict[tuple[str, str], dict]:
    """(task, metric) -> the paired statistics summary.json reports, checked."""
    summary = _load_json(_read_text(summary_path), str(summary_path))
    rows = summary.get("rows") if isinstance(summary, dict) else None
    if not isinstance(rows, list):
        raise KHAError(f"{summary_path}: not a kha eval summary (a JSON object with a 'rows' list)")
    reported = {}
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("task"), str) or not isinstance(row.get("metric"), str):
            raise KHAError(f"{summary_path}: rows[{i}] is not a row with a task and a metric")
        if "paired" in row:
            reported[(row["task"], row["metric"])] = row["paired"]
    return reported


def _pm(value: float, stderr: float | None) -> str:
    return f"{value:.4f} ± {stderr:.4f}" if stderr is not None else f"{value:.4f}"


def _p(p: float | None) -> str:
    return "–" if p is None else ("1" if p == 1 else f"{p:.3g}")


def format_delta(row: dict) -> tuple[str, str, str]:
    """('Δ [95 % CI]', 'p', 'Holm p') cells of a comparison row; an interval that cannot be given shows as '–'."""
    paired = row.get("paired")
    if paired is None:
        return f"{row['delta']:+.4f} (not paired)", "–", "–"
    interval = paired["ci95"]
    cell = f"{paired['delta']:+.4f} " + (f"[{interval[0]:+.4f}, {interval[1]:+.4f}]" if interval else "[–]")
    if row.get("paired_unit"):
        cell += " log-lik"
    return cell, _p(paired["p_value"]), _p(paired.get("p_holm")) + (" ✓" if row.get("significant") else "")


LEGEND = (
    "Δ = candidate − baseline over the same documents (log-lik: Δ of each document's log-likelihood, higher = "
    "candidate better, while perplexity is lower = better). 0/1 metrics: exact interval (Clopper-Pearson on the "
    "discordant documents) and exact McNemar p, one method, so the two agree; continuous metrics: t-interval and a "
    "paired permutation p, which can disagree near 0.05. Holm: p adjusted over all rows of this table; ✓ = survives "
    "at 0.05. – = no interval or test (fewer than 2 documents, or no spread). Per-document scores: "
    f"{PER_DOCUMENT_FILE}; `kha eval --recompute DIR` reproduces every p from them."
)


def markdown_table(rows: list[dict], baseline, candidate) -> str:
    if baseline is None:
        lines = ["| task | metric | candidate |", "|---|---|---|"]
        lines += [f"| {r['task']} | {r['metric']} | {_pm(r['candidate'], r['candidate_stderr'])} |" for r in rows]
    else:
        lines = [
            "| task | metric | baseline | candidate | Δ [95 % CI] (paired) | p | Holm p | n |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            if "baseline" not in r:
                continue
            delta, p, p_holm = format_delta(r)
            n = r["paired"]["n"] if "paired" in r else ""
            lines.append(
                f"| {r['task']} | {r['metric']} | {_pm(r['baseline'], r['baseline_stderr'])} | "
                f"{_pm(r['candidate'], r['candidate_stderr'])} | {delta} | {p} | {p_holm} | {n} |"
            )
        lines += ["", LEGEND]
    models = [m for m in (baseline, candidate) if m is not None]
    if any(m.perplexity for m in models):
        lines += ["", "| model | perplexity | tokens | method |", "|---|---|---|---|"]
        for m in models:
            p = m.perplexity
            lines.append(f"| {m.label}: {m.ref} | {p['perplexity']:.3f} | {p['tokens']} | {p['method']} |")
    return "\n".join(lines) + "\n"
