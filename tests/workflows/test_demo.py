"""`kha demo` end to end on a tiny model: conversion, knocks, the parameter-matched LoRA control, paired eval."""

import json

import pytest
from transformers import AutoModelForCausalLM

from kha_hf.workflows.demo import run_demo
from tests.helpers import save_tiny_tokenizer, tiny_configs


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("demo")
    config = tiny_configs()["llama"]
    config.vocab_size = 300  # the tiny tokenizer's ids
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp / "base")
    save_tiny_tokenizer(tmp / "base")
    summary = run_demo(str(tmp / "base"), output=tmp / "demo", train_steps=2, limit=3)
    return tmp / "demo", summary


def test_demo_trains_knocks_and_a_matched_lora_control(demo_run):
    out, summary = demo_run
    params = summary["parameters"]
    assert params["kha-knocks"] == 3 * 16**2 * 3 and params["lora"] == params["kha-knocks"]
    assert params["lora_targets"] == ["v_proj"] and params["lora_rank"] == 8
    table = (out / "comparison.md").read_text()
    assert f"| KHA, knocks trained | {params['kha-knocks']:,} |" in table
    assert "| control: LoRA r=8 on v_proj | 2,304 |" in table
    assert "cannot show" in table  # the sentence on what this run can and cannot show
    for name in ("kha-knocks", "lora"):
        rows = summary["rows"][name]
        assert {r["task"] for r in rows} == {"arc_easy", "piqa", "copa", "winogrande"}
        assert all(r["paired"]["n"] == 3 for r in rows)
    assert summary["heldout_loss"]["base"] != summary["heldout_loss"]["kha-knocks"]


def test_demo_keeps_only_what_the_user_looks_at(demo_run):
    out, _ = demo_run
    assert json.loads((out / "summary.json").read_text())["training_tokens"] == 2 * 4 * 256
    assert (out / "knocks.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "kha-trained" / "config.json").is_file() and (out / "kha" / "config.json").is_file()
    assert not list(out.rglob("checkpoint-*")), "no intermediate checkpoints with optimizer state"
    assert not list(out.rglob("optimizer.pt"))
