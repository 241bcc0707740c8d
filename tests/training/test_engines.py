"""`kha train` from a converted checkpoint on the engines users scale on, each with its shipped accelerate config on 2
processes (gloo on CPUs): DDP, FSDP2 (full and sharded state dicts), DeepSpeed ZeRO-2 and ZeRO-3. Each run must say
it ran the engine its config names; the knocks start where the checkpoint left them and are never decayed on any
rank; the final save loads with from_pretrained and gives the trained model's held-out loss.

From a config (new weights), with 1-process parity per step: test_resume_exact.py, whose uninterrupted run on each
engine is that run (one launch less per engine).
"""

import json

import pytest

from tests.training.engines import ENGINES, EXPECTED, RUN, engines, heldout_loss, kha_train


# CI: FSDP2 (the model sharded at load from the converted weights) and ZeRO-3 (partitioned at load). DDP and ZeRO-2
# load the whole checkpoint on every rank, as 1 process does (tests/training/test_train.py), and FSDP2's FULL save
# differs from SHARDED only after training (test_resume_exact.py runs both): the exhaustive tier (KHA_EXHAUSTIVE=1).
@pytest.mark.parametrize("engine", engines(*ENGINES, exhaustive=("ddp", "zero2", "fsdp2-full")))
def test_from_a_converted_checkpoint(engine, prepared, kha_dir, tmp_path):
    out = tmp_path / "run"
    proc = kha_train(
        [kha_dir, "--data", prepared, "--mode", "full", "--max-steps", "2", "--batch-size", "2", *RUN, "--output", out],
        engine,
        tmp_path,
    )
    assert f"engine: {EXPECTED[engine]} on 2 process(es)" in proc.stdout
    # kha_dir's knocks were trained briefly: they start where it left them, still never decayed
    assert "on all 2 ranks; weight decay on knocks: [0.0]" in proc.stdout
    reported = json.loads((out / "eval_results.json").read_text())["eval_loss"]
    assert abs(heldout_loss(out, prepared) - reported) < 1e-5
