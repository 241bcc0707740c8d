"""Every command of the product on every family of the table: convert, verify, inspect, train, fold, eval, serve.

Each family is a tiny random stock checkpoint (vocabulary 300, so the tiny tokenizer fits) saved as a user would
have it; the commands run through `kha_hf.cli.main` (eval and serve through their Python entry points, on one task
and one request, to keep the run short; on five representative families in CI, on every family with KHA_EXHAUSTIVE=1).
The families of tests/helpers.py's EXHAUSTIVE_FAMILIES run in the exhaustive tier only.
"""

from __future__ import annotations

import json

import pytest
import requests

from kha_hf.cli import main
from tests.helpers import ALL_FAMILIES, EXHAUSTIVE, MLA_FAMILIES, family_params, free_port, save_tiny_checkpoint

FAMILIES = [f for f in ALL_FAMILIES if f != "llama_bias"]
# eval and serve on these in CI (a dense decoder, MLA, routed experts, a hybrid, attention sinks); on every family in
# the exhaustive tier (tests/conftest.py, KHA_EXHAUSTIVE=1)
SERVED_AND_EVALUATED = {"llama", "deepseek_v3", "qwen3_moe", "qwen3_next", "gpt_oss"}


@pytest.fixture(scope="module")
def task_manager():
    from lm_eval.tasks import TaskManager

    return TaskManager()


@pytest.mark.parametrize("family", family_params(FAMILIES))
def test_every_command_on_every_family(family, tmp_path, task_manager, capsys):
    base, kha, linear = tmp_path / "base", tmp_path / "kha", tmp_path / "linear"
    save_tiny_checkpoint(base, family)
    preset = "linear_v" if family in MLA_FAMILIES else "mlp_v"
    assert main(["convert", str(base), str(kha), "--knock", preset, "--verify"]) == 0
    assert "verified: the KHA checkpoint reproduces its base model" in capsys.readouterr().out
    assert main(["verify", str(base), str(kha)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(kha), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and {r["knock"] for r in rows} <= {"v", "v.up", "v.gate", "v.down"}

    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 80)
    train = ["train", str(kha), "--data", str(text), "--max-steps", "1", "--seq-len", "16", "--batch-size", "2"]
    assert main([*train, "--output", str(tmp_path / "trained")]) == 0

    assert main(["convert", str(base), str(linear), "--knock", "linear_qkv"]) == 0
    assert main(["fold", str(linear), str(tmp_path / "folded")]) == 0
    folded = json.loads((tmp_path / "folded" / "config.json").read_text())
    assert folded["model_type"] == json.loads((base / "config.json").read_text())["model_type"]

    if family not in SERVED_AND_EVALUATED and not EXHAUSTIVE:
        return  # eval and serve load what convert --verify and train loaded; the exhaustive tier runs them here too
    from kha_hf.eval.compare import evaluate_model

    result = evaluate_model(
        "candidate",
        str(tmp_path / "trained"),
        ["copa"],
        True,
        2,
        0,
        2,
        "cpu",
        "float32",
        1234,
        None,
        task_manager=task_manager,
    )
    assert ("copa", "acc") in result.metrics

    from kha_hf.serving.server import start_server

    port = free_port()
    server = start_server(str(kha), port=port, device="cpu", dtype="float32")
    try:
        reply = requests.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": "the quick", "max_tokens": 3, "temperature": 0},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
    finally:
        server.kill_server()
