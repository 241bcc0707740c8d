"""`kha eval`: lm-eval wiring, local task copies, the comparison table, and a real SmolLM2 check."""

import json
import math

import pytest
import torch

from kha_hf.common.errors import KHAError
from kha_hf.eval.compare import ModelResult, requested_groups, summarize
from kha_hf.eval.local_tasks import LOCAL_TASK_NAMES, local_task_configs
from kha_hf.eval.paired import comparison_rows, markdown_table
from kha_hf.eval.perplexity import strided_perplexity
from kha_hf.eval.suites import SUITES, resolve_tasks


@pytest.fixture(scope="module")
def task_manager():
    from lm_eval.tasks import TaskManager

    return TaskManager()


def test_every_offline_task_renders_lm_eval_prompts_from_the_local_copy(task_manager):
    from lm_eval.api.task import ConfigurableTask

    configs, groups = local_task_configs(list(LOCAL_TASK_NAMES), task_manager)
    assert len(groups["mmlu"]) == 57
    names = {c["task"] for c in configs}
    assert set(LOCAL_TASK_NAMES) - {"mmlu"} <= names
    for config in configs:
        if config["task"].startswith("mmlu_") and config["task"] not in ("mmlu_anatomy", "mmlu_virology"):
            continue  # two subjects stand for all 57: same template
        task = ConfigurableTask(config=config)
        docs = list(task.test_docs() if task.has_test_docs() else task.validation_docs())
        assert len(docs) > 10, config["task"]
        doc = docs[0]
        text, target, choices = task.doc_to_text(doc), task.doc_to_target(doc), task.doc_to_choice(doc)
        assert isinstance(choices, list) and len(choices) >= 2, config["task"]
        if isinstance(text, int):  # winogrande: choices are contexts, the text is the gold one's index
            assert 0 <= text < len(choices) and isinstance(target, str) and target.strip()
            continue
        assert text.strip(), config["task"]
        index = target if isinstance(target, int) else choices.index(target)
        assert 0 <= index < len(choices), (config["task"], target, choices)


def test_local_mode_rejects_tasks_without_a_copy(task_manager):
    with pytest.raises(KHAError, match="no local copy of gsm8k"):
        local_task_configs(["gsm8k"], task_manager)


def test_suites():
    assert {"mmlu", "arc_easy", "arc_challenge", "hellaswag", "piqa", "commonsense_qa", "race", "gsm8k"} <= set(
        SUITES["paper"]
    )
    assert set(SUITES["quick"]) <= set(LOCAL_TASK_NAMES)
    assert resolve_tasks(None, None) == SUITES["quick"]
    with pytest.raises(KHAError, match="unknown suite"):
        resolve_tasks(None, "everything")


def test_summary_aggregates_groups_and_table_shows_paired_statistics():
    results = {
        "mmlu_a": {"acc,none": 0.5, "acc_stderr,none": 0.1},
        "mmlu_b": {"acc,none": 0.2, "acc_stderr,none": 0.05},
        "arc_easy": {"acc,none": 0.6, "acc_stderr,none": 0.01, "acc_norm,none": 0.55, "acc_norm_stderr,none": 0.01},
    }
    n = {"mmlu_a": {"effective": 10}, "mmlu_b": {"effective": 30}, "arc_easy": {"effective": 100}}
    metrics = summarize(results, {"mmlu": ["mmlu_a", "mmlu_b"]}, n)
    assert set(metrics) == {("mmlu", "acc"), ("arc_easy", "acc"), ("arc_easy", "acc_norm")}
    acc, se = metrics[("mmlu", "acc")]
    assert acc == pytest.approx((0.5 * 10 + 0.2 * 30) / 40)
    assert se == pytest.approx(math.sqrt((10 * 0.1) ** 2 + (30 * 0.05) ** 2) / 40)

    # t: the candidate fixes 9 documents and breaks 1 (McNemar p = 2 * 11/1024); u: 3 fixed, 3 broken (p = 1)
    docs = [("t", i) for i in range(40)]
    b_t = {d: (float(i < 20), f"h{i}") for i, d in enumerate(docs)}
    c_t = {d: (float(i < 20 and i != 0 or 20 <= i < 29), f"h{i}") for i, d in enumerate(docs)}
    b_u = {d: (float(i < 10), f"h{i}") for i, d in enumerate(docs)}
    c_u = {d: (float(3 <= i < 13), f"h{i}") for i, d in enumerate(docs)}
    base = ModelResult("baseline", "a", {("t", "acc"): (0.50, 0.08), ("u", "acc"): (0.25, 0.07)})
    cand = ModelResult("candidate", "b", {("t", "acc"): (0.70, 0.07), ("u", "acc"): (0.25, 0.07)})
    base.per_doc = {("t", "acc"): b_t, ("u", "acc"): b_u}
    cand.per_doc = {("t", "acc"): c_t, ("u", "acc"): c_u}
    rows = {r["task"]: r for r in comparison_rows(base, cand)}
    t, u = rows["t"]["paired"], rows["u"]["paired"]
    assert t["delta"] == pytest.approx(0.2) and t["n"] == 40 and t["discordant"] == 10
    assert t["p_value"] == pytest.approx(2 * 11 / 1024) and rows["t"]["significant"]
    assert t["p_holm"] == pytest.approx(2 * 2 * 11 / 1024)  # Holm over the two rows: the smallest p times 2
    assert u["delta"] == 0 and u["p_value"] == 1 and not rows["u"]["significant"]
    table = markdown_table(list(rows.values()), base, cand)
    low, high = t["ci95"]
    row = f"| t | acc | 0.5000 ± 0.0800 | 0.7000 ± 0.0700 | +0.2000 [{low:+.4f}, {high:+.4f}] | 0.0215 | 0.043 ✓ | 40 |"
    assert row in table
    single = markdown_table(comparison_rows(None, cand), None, cand)
    assert single.splitlines()[0] == "| task | metric | candidate |"


def test_online_groups_are_pooled_over_their_leaf_tasks():
    subtasks = {
        "mmlu": ["mmlu_stem", "mmlu_humanities"],
        "mmlu_stem": ["mmlu_physics", "mmlu_math"],
        "mmlu_humanities": ["mmlu_law"],
    }
    groups = requested_groups(subtasks, ["mmlu", "arc_easy"])
    assert groups == {"mmlu": ["mmlu_physics", "mmlu_math", "mmlu_law"]}


def test_strided_perplexity_matches_a_full_window_forward():
    from kha_hf import KHAForCausalLM
    from kha_hf.training.tokenizer import train_bpe_tokenizer
    from tests.helpers import tiny_base_model

    text = "to be or not to be that is the question " * 20
    tokenizer = train_bpe_tokenizer([text], 300)
    model = KHAForCausalLM.from_base(tiny_base_model("llama"))
    model.resize_token_embeddings(len(tokenizer))
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = math.exp(model(ids, labels=ids).loss.item())
    ppl, scored = strided_perplexity(model, tokenizer, text, max_length=256, stride=128)
    assert scored == ids.shape[1] - 1
    assert ppl == pytest.approx(expected, rel=1e-4)  # one window covers the text: identical to a full forward
    windowed, scored_windowed = strided_perplexity(model, tokenizer, text, max_length=32, stride=16)
    assert scored_windowed == scored  # overlapping windows still score every token exactly once
    assert windowed == pytest.approx(expected, rel=0.2)


@pytest.mark.slow
def test_smollm2_and_its_kha_conversion_score_identically(tmp_path, capsys):
    from kha_hf.cli import main
    from kha_hf.common.assets import smollm2_gguf
    from kha_hf.conversion import convert

    gguf = smollm2_gguf()
    kha = convert(gguf, tmp_path / "smollm2-kha", progress=False).output
    (tmp_path / "text.txt").write_text(
        "Shall I compare thee to a summer's day? Thou art more lovely and more temperate."
    )
    argv = [
        "eval",
        "--baseline",
        str(gguf),
        "--candidate",
        str(kha),
        "--tasks",
        "arc_easy,copa",  # lm-eval's comma-separated form
        "--limit",
        "8",
        "--output",
        str(tmp_path / "eval"),
        "--perplexity",
        str(tmp_path / "text.txt"),
    ]
    assert main(argv) == 0  # HF_HUB_OFFLINE=1 (conftest): local data must be chosen automatically, and said
    assert "the Hugging Face Hub cannot be reached: using the local eval copies" in capsys.readouterr().out
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    rows = summary["rows"]
    assert {r["task"] for r in rows} == {"arc_easy", "copa"}
    for row in rows:
        assert row["baseline"] == row["candidate"] and row["delta"] == 0 and not row["significant"], row
        paired = row["paired"]
        assert paired["delta"] == 0 and paired["ci95"] is None and paired["p_value"] == 1, paired
        assert paired["n"] == 8 and paired["discordant"] == 0 and paired["p_holm"] == 1
    ppl = summary["perplexity"]
    assert ppl["baseline"]["perplexity"] == ppl["candidate"]["perplexity"] > 1
    table = (tmp_path / "eval" / "table.md").read_text()
    assert "| arc_easy | acc |" in table and "| copa | acc |" in table
    assert "+0.0000 [–] | 1 | 1 | 8 |" in table
    records = [json.loads(line) for line in (tmp_path / "eval" / "per_document.jsonl").read_text().splitlines()]
    assert len(records) == sum(r["paired"]["n"] for r in rows) and all(r["doc_hash"] for r in records)
    capsys.readouterr()
    assert main(["eval", "--recompute", str(tmp_path / "eval")]) == 0
    assert "every paired statistic equals" in capsys.readouterr().out
    raw = json.loads((tmp_path / "eval" / "candidate_lm_eval.json").read_text())
    assert raw["results"]["arc_easy"]["sample_len"] == 8 and "n-samples" in raw
    assert summary["local_data_notes"] == {"arc_easy": "validation split (standard: test)"}
    assert (tmp_path / "eval" / "baseline_lm_eval.json").exists()


def test_only_the_expected_lm_eval_warnings_are_silenced(caplog):
    import logging

    from kha_hf.eval.quiet import quiet_lm_eval

    logger = logging.getLogger("lm_eval.api.task")
    with caplog.at_level(logging.WARNING), quiet_lm_eval():
        logger.warning("[Task: copa] metric acc is defined, but aggregation is not. using default aggregation=mean")
        logger.warning("something real went wrong")
    assert [r.getMessage() for r in caplog.records] == ["something real went wrong"]
    logger.warning("[Task: copa] metric acc is defined, but aggregation is not.")  # outside: shown again
    assert len(caplog.records) == 2


def test_lm_eval_s_already_initialized_model_warning_is_silenced_at_our_call(caplog, tmp_path):
    # lm-eval 0.4.13 warns once per HFLM built from a model object, which is how kha eval hands it models; the
    # filter must still match what lm-eval prints (a changed wording would make the line reappear)
    import logging

    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer, LlamaForCausalLM

    from kha_hf.eval.quiet import quiet_lm_eval
    from tests.helpers import save_tiny_tokenizer, tiny_config

    model = LlamaForCausalLM(tiny_config("llama")).eval()
    save_tiny_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    with caplog.at_level(logging.INFO):
        HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1, device="cpu")
    assert any("already-initialized model" in r.getMessage() for r in caplog.records), "upstream wording changed"
    caplog.clear()
    with caplog.at_level(logging.INFO), quiet_lm_eval():
        HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1, device="cpu")
    shown = [r.getMessage() for r in caplog.records]
    assert not any("already-initialized model" in m or "is not of type `str`" in m for m in shown), shown


def test_lm_eval_s_git_probe_prints_nothing_outside_a_checkout(tmp_path, monkeypatch, capfd):
    # lm-eval 0.4.13 runs `git describe` with our stderr: "fatal: not a git repository" on every evaluation
    import lm_eval.evaluator

    from kha_hf.eval.quiet import quiet_lm_eval

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # tmp_path is in no checkout
    lm_eval.evaluator.get_git_commit_hash()
    assert "fatal" in capfd.readouterr().err, "upstream no longer prints git's error: drop the workaround"
    with quiet_lm_eval():
        assert lm_eval.evaluator.get_git_commit_hash() is None
    assert capfd.readouterr().err == ""
    assert lm_eval.evaluator.get_git_commit_hash.__module__ == "lm_eval.loggers.utils"  # restored
