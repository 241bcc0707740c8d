"""`kha train` on the engines users scale on, each with its shipped accelerate config on 2 processes (gloo on CPUs):
DDP, FSDP2 (full and sharded state dicts; transformers shards the model at load time), DeepSpeed ZeRO-2 and ZeRO-3;
each run must say it ran the engine its config names. From a config (new weights) and from a
converted checkpoint; the knocks start at the identity and are never decayed on any rank; the final save loads
with from_pretrained and gives the trained model's held-out loss.

A 2-process run with batch 2 a process and a 1-process run with batch 4 read the same blocks at every step (one
global order from the seed, each rank its share of every global batch): their losses agree within 1e-4 on every
engine that builds the same initial weights. ZeRO-3 builds the model partitioned (deepspeed.zero.Init), whose
initialisation draws its random numbers in another order, so its weights, not its data, differ from one process's.
"""

import json

import pytest

from kha_hf.common.model_code import model_code_files
from tests.training.engines import ENGINES, EXPECTED, RUN, heldout_loss, kha_train, logged_losses

TOLERANCE = 1e-4  # per logged loss: the same batches, reduced in another order


@pytest.fixture(scope="module")
def one_process(prepared, tmp_path_factory):
    """The reference: the same run on 1 process with the whole global batch."""
    out = tmp_path_factory.mktemp("one") / "run"
    kha_train(
        [
            "cpu-tiny",
            "--data",
            prepared,
            "--mode",
            "full",
            "--max-steps",
            "4",
            "--batch-size",
            "4",
            *RUN,
            "--output",
            out,
        ],
        None,
        out.parent,
    )
    return logged_losses(out)


@pytest.mark.parametrize("engine", ENGINES)
def test_from_a_config(engine, prepared, one_process, tmp_path):
    out = tmp_path / "run"
    proc = kha_train(
        [
            "cpu-tiny",
            "--data",
            prepared,
            "--mode",
            "full",
            "--max-steps",
            "4",
            "--batch-size",
            "2",
            *RUN,
            "--output",
            out,
        ],
        engine,
        tmp_path,
    )
    assert f"engine: {EXPECTED[engine]} on 2 process(es)" in proc.stdout  # what ran is what the config asked for
    assert "knocks at the start: identity on all 2 ranks; weight decay on knocks: [0.0]" in proc.stdout
    losses = logged_losses(out)
    assert sorted(losses) == [1, 2, 3, 4]
    if engine != "zero3":
        worst = max(abs(losses[s] - one_process[s]) for s in losses)
        assert worst < TOLERANCE, (losses, one_process)
    # the final save is the trained model: from_pretrained gives the loss the run measured on the held-out blocks
    reported = json.loads((out / "eval_results.json").read_text())["eval_loss"]
    assert abs(heldout_loss(out, prepared) - reported) < 1e-5
    assert json.loads((out / "kha_data.json").read_text())["seed"] == 0
    # nothing left beside or inside the output (an FSDP2 run from a config builds its weights in a `.kha-init-*`
    # folder of its working folder and removes it once every rank has loaded its shard)
    assert not list(tmp_path.glob(".kha-*")) and not list(out.glob(".kha-init-*"))
    # no foreign file: the code next to the weights is KHA's, as a plain save_pretrained writes it, under any engine
    assert {p.name for p in out.glob("*.py")} == {p.name for p in model_code_files()}


@pytest.mark.parametrize("engine", ENGINES)
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
