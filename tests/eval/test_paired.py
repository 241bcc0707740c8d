"""The paired comparison's bookkeeping: documents paired by id and doc_hash, log-likelihood rows, the audit trail."""

import json

import pytest

from kha_hf.cli import main
from kha_hf.common.errors import KHAError
from kha_hf.eval.compare import ModelResult
from kha_hf.eval.paired import (
    PER_DOCUMENT_FILE,
    comparison_rows,
    pair,
    per_document_records,
    recompute,
    write_per_document,
)


def _result(label, metrics, per_doc):
    result = ModelResult(label, label, metrics)
    result.per_doc = per_doc
    return result


def test_same_ids_over_different_documents_are_refused():
    baseline = {("t", i): (1.0, f"h{i}") for i in range(5)}
    candidate = {("t", i): (0.0, f"h{i}" if i != 3 else "other") for i in range(5)}
    with pytest.raises(KHAError, match="1 of 5 document ids hold different documents"):
        pair(baseline, candidate, ("t", "acc"))


def test_documents_scored_by_one_model_only_are_refused():
    with pytest.raises(KHAError, match="different documents"):
        pair({("t", 0): (1.0, "a")}, {("t", 1): (1.0, "b")}, ("t", "acc"))


def test_log_likelihood_rows_say_their_unit():
    docs_b = {("lambada", i): (-2.0 - i, f"h{i}") for i in range(6)}
    docs_c = {("lambada", i): (-1.5 - i, f"h{i}") for i in range(6)}
    base = _result("baseline", {("lambada", "perplexity"): (20.0, 1.0)}, {("lambada", "perplexity"): docs_b})
    cand = _result("candidate", {("lambada", "perplexity"): (12.0, 1.0)}, {("lambada", "perplexity"): docs_c})
    (row,) = comparison_rows(base, cand)
    assert row["delta"] < 0  # perplexity fell: the candidate is better
    assert row["paired"]["delta"] > 0 and "log-likelihood" in row["paired_unit"]  # log-likelihood rose: better


def test_recompute_reproduces_every_p_and_notices_a_changed_score(tmp_path, capsys):
    docs = [("t", i) for i in range(30)]
    per_doc_b = {("t", "acc"): {d: (float(i % 3 == 0), f"h{i}") for i, d in enumerate(docs)}}
    per_doc_c = {("t", "acc"): {d: (float(i % 2 == 0), f"h{i}") for i, d in enumerate(docs)}}
    metrics = {("t", "acc"): (0.5, 0.1)}
    base, cand = _result("baseline", metrics, per_doc_b), _result("candidate", metrics, per_doc_c)
    rows = comparison_rows(base, cand)
    write_per_document(tmp_path / PER_DOCUMENT_FILE, per_document_records(base, cand))
    (tmp_path / "summary.json").write_text(json.dumps({"rows": rows}))
    assert recompute(tmp_path)["matches"]
    assert main(["eval", "--recompute", str(tmp_path)]) == 0
    lines = (tmp_path / PER_DOCUMENT_FILE).read_text().splitlines()
    record = json.loads(lines[0])
    record["candidate"] = 1 - record["candidate"]
    (tmp_path / PER_DOCUMENT_FILE).write_text("\n".join([json.dumps(record), *lines[1:]]) + "\n")
    result = recompute(tmp_path)
    assert not result["matches"] and result["mismatches"] == ["t acc"]
    assert main(["eval", "--recompute", str(tmp_path)]) == 1
