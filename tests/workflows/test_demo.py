"""`kha demo` end to end on a tiny model: conversion, knocks, the parameter-matched LoRA control, paired eval."""

import contextlib
import io
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
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        summary = run_demo(str(tmp / "base"), output=tmp / "demo", train_steps=2, limit=3)
    return tmp / "demo", summary, out.getvalue(), err.getvalue()


def test_every_phase_reports_progress(demo_run):
    # Each long phase has its own progress display, so no phase can run silently for long: the conversion's shard
    # bar, the Trainer's step bar and one line per log, lm-eval's request bar, and a header per phase.
    _, _, out, err = demo_run
    for phase in ("[1/5] convert", "[2/5] train the knocks", "[3/5] train the control", "[4/5] evaluate", "[5/5]"):
        assert phase in out
    assert "shards" in err  # conversion
    assert out.count("step 2/2  loss") + err.count("step 2/2  loss") == 2  # both arms, readable lines
    assert "{'loss'" not in out + err, "raw Trainer dicts"
    assert "Running loglikelihood requests" in err  # lm-eval's progress bar
    assert "next, offline, on these outputs:" in out and "disk used:" in out


def test_demo_ends_with_next_steps_on_its_own_outputs(tmp_path):
    from kha_hf.cli import build_parser
    from kha_hf.workflows.demo import next_steps

    commands = next_steps("/models/smollm2.gguf", tmp_path / "demo")
    assert len(commands) == 3
    parser = build_parser()
    for command in commands:
        for part in command.split("#")[0].split("&&"):
            words = part.split()
            assert words[0] == "kha" and str(tmp_path / "demo") in part
            parser.parse_args(words[1:])  # each is a valid kha command line


def test_demo_trains_knocks_and_a_matched_lora_control(demo_run):
    out, summary, _, _ = demo_run
    params = summary["parameters"]
    assert params["kha-knocks"] == 3 * 16**2 * 3 and params["lora"] == params["kha-knocks"]
    assert params["lora_targets"] == ["v_proj"] and params["lora_rank"] == 8
    table = (out / "comparison.md").read_text()
    assert f"| KHA, knocks trained | {params['kha-knocks']:,} |" in table
    assert "| control: LoRA r=8 on v_proj | 2,304 |" in table
    assert "The control is not tuned here" in table and "kha ab --from" in table  # what this run cannot show
    assert "the same number of new parameters" in table  # exact for mlp_v
    assert "| Holm p |" in table and "survive Holm's correction" in table
    for name in ("kha-knocks", "lora"):
        rows = summary["rows"][name]
        assert {r["task"] for r in rows} == {"arc_easy", "piqa", "copa", "winogrande"}
        assert all(r["paired"]["n"] == 3 and "p_holm" in r["paired"] for r in rows)
    assert summary["heldout_loss"]["base"] != summary["heldout_loss"]["kha-knocks"]


def test_demo_keeps_only_what_the_user_looks_at(demo_run):
    out, _, _, _ = demo_run
    assert json.loads((out / "summary.json").read_text())["training_tokens"] == 2 * 4 * 256
    assert (out / "knocks.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "kha-trained" / "config.json").is_file() and (out / "kha" / "config.json").is_file()
    assert not list(out.rglob("checkpoint-*")), "no intermediate checkpoints with optimizer state"
    assert not list(out.rglob("optimizer.pt"))
