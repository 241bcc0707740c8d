"""`kha ab --from MODEL`: four arms on one converted checkpoint, a parameter-matched LoRA control, paired over seeds."""

import csv
import json

import pytest

from kha_hf.cli import main
from kha_hf.training.data import read_documents
from kha_hf.training.modes import lora_targets, matched_lora_rank
from tests.helpers import save_tiny_tokenizer, tiny_base_model, tiny_configs


def test_lora_targets_follow_the_knocks():
    assert lora_targets("mlp_v") == ["v_proj"] and lora_targets("linear_v") == ["v_proj"]
    assert lora_targets("linear_qkv") == ["q_proj", "k_proj", "v_proj"]


def test_matched_rank_by_hand():
    model = tiny_base_model("llama")  # hidden 64, 3 layers, v_proj 64 -> 32 (2 KV heads of 16)
    knock_parameters = 3 * 16**2 * 3  # mlp_v: up, gate, down per layer
    rank, count = matched_lora_rank(model, ["v_proj"], knock_parameters)
    assert (rank, count) == (8, 8 * (64 + 32) * 3) and count == knock_parameters


def test_continued_ab_runs_four_arms_with_matched_control(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    config = tiny_configs()["llama"]
    config.vocab_size = 300  # the tiny tokenizer's ids
    AutoModelForCausalLM.from_config(config).save_pretrained(base)
    save_tiny_tokenizer(base)
    (tmp_path / "data.md").write_text(read_documents(None)[0][:20000])
    argv = ["ab", "--from", str(base), "--output", str(tmp_path / "out"), "--seeds", "2", "--max-steps", "3"]
    argv += ["--seq-len", "32", "--batch-size", "2", "--data", str(tmp_path / "data.md")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "trainable parameters: knocks 2,304; LoRA r=8 on v_proj: 2,304 (0.0% apart)" in out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert set(summary["arms"]) == {"base-full", "kha-full", "kha-knocks", "lora-matched"}
    arms = summary["arms"]
    assert arms["kha-knocks"]["trainable_parameters"] == 2304
    assert abs(arms["lora-matched"]["trainable_parameters"] - 2304) <= 0.05 * 2304
    assert arms["kha-full"]["trainable_parameters"] == arms["base-full"]["trainable_parameters"] + 2304
    # converted model = base model before training: identical held-out loss for all four arms
    befores = {a["heldout_before_mean"] for a in arms.values()}
    assert max(befores) - min(befores) < 1e-6, befores
    comparisons = {(c["arm"], c["control"]): c for c in summary["comparisons"]}
    full = comparisons[("kha-full", "base-full")]
    assert [p["seed"] for p in full["per_seed"]] == [0, 1] and full["n_seeds"] == 2
    assert full["delta_mean"] == pytest.approx(sum(p["delta"] for p in full["per_seed"]) / 2)
    for p in comparisons[("kha-knocks", "lora-matched")]["per_seed"]:
        assert p["delta"] == pytest.approx(p["kha-knocks_heldout"] - p["lora-matched_heldout"])
    rows = list(csv.DictReader(open(tmp_path / "out" / "loss_curves.csv")))
    assert set(rows[0]) == {"seed", "step", "base-full_loss", "kha-full_loss", "kha-knocks_loss", "lora-matched_loss"}
    assert (tmp_path / "out" / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"


def test_continued_ab_eval_adds_paired_downstream_statistics(tmp_path):
    from transformers import AutoModelForCausalLM

    from kha_hf.workflows.continued_ab import continued_ab

    base = tmp_path / "base"
    config = tiny_configs()["llama"]
    config.vocab_size = 300
    AutoModelForCausalLM.from_config(config).save_pretrained(base)
    save_tiny_tokenizer(base)
    (tmp_path / "data.md").write_text(read_documents(None)[0][:20000])
    summary = continued_ab(
        str(base),
        output=tmp_path / "out",
        max_steps=2,
        seq_len=32,
        batch_size=2,
        seeds=1,
        data=[str(tmp_path / "data.md")],
        run_eval=True,
        limit=2,
    )
    pairs = {(e["arm"], e["control"]): e["rows"] for e in summary["eval"]}
    assert set(pairs) == {("kha-full", "base-full"), ("kha-knocks", "lora-matched")}
    for rows in pairs.values():
        assert {r["task"] for r in rows} == {"arc_easy", "piqa", "copa", "winogrande"}
        assert all(r["paired"]["n"] == 2 and "p_value" in r["paired"] for r in rows)
    assert "kha-knocks vs lora-matched" in (tmp_path / "out" / "eval.md").read_text()


def test_from_takes_a_preset_for_its_size_but_not_a_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert main(["ab", str(tmp_path / "config.json"), "--from", str(tmp_path)]) == 2
    assert "with --from, the positional argument is a preset" in capsys.readouterr().err
