"""`kha train` from a config on every engine users scale on, uninterrupted and killed: each engine with its shipped
accelerate config on 2 processes (gloo on CPUs): DDP, FSDP2 (full and sharded state dicts; transformers shards the
model at load time), DeepSpeed ZeRO-2 and ZeRO-3.

The uninterrupted run (`from a config`, new weights) must say it ran the engine its config names, start its knocks at
the identity and never decay them on any rank, and leave a final save that loads with from_pretrained and gives the
run's held-out loss. A 2-process run with batch 2 a process and a 1-process run with batch 4 read the same blocks at
every step (one global order from the seed, each rank its share of every global batch): their losses agree within
1e-4 on every engine that builds the same initial weights. ZeRO-3 builds the model partitioned
(deepspeed.zero.Init), whose initialisation draws its random numbers in another order, so its weights, not its data,
differ from one process's. (From a converted checkpoint: test_engines.py.)

Then `kill -9` the same run after its first checkpoint and `--resume` it: it continues from that checkpoint at the
exact data position (no block repeated, none skipped), and every logged loss equals the uninterrupted run's within
1e-5 (CPU, float32), on 1 process and on every engine (FSDP2's optimizer, scheduler and random states are saved by
kha itself: training/run_state.py). `--resume` with another seed or another corpus than the run it resumes is
refused in one line."""

import json
import os
import signal
import subprocess
import time

import psutil
import pytest

from kha_hf.common.model_code import model_code_files
from kha_hf.data.prepare import tokenize_corpus
from kha_hf.training.run_state import RUN_STATE_FILE
from tests.helpers import EXHAUSTIVE
from tests.training.engines import (
    ENGINES,
    EXPECTED,
    RUN,
    engines,
    heldout_loss,
    kha_env,
    kha_train,
    launcher,
    logged_losses,
)

TOLERANCE = 1e-5  # a resumed run against the same run uninterrupted: the same arithmetic
ENGINE_TOLERANCE = 1e-4  # 2 processes against 1 per logged loss: the same batches, reduced in another order
STEPS, SAVE = 24, 8  # a checkpoint, the kill, 16 steps resumed: what differs in a resume shows in its first steps


def args(prepared, out, processes: int) -> list:
    batch = "4" if processes == 1 else "2"  # the same global batch
    return [
        "cpu-tiny",
        "--data",
        prepared,
        "--mode",
        "full",
        "--max-steps",
        str(STEPS),
        "--save-steps",
        str(SAVE),
        "--batch-size",
        batch,
        *RUN,
        "--output",
        out,
    ]


def kill_after_first_checkpoint(command: list, tmp_path, out, mark: str = "trainer_state.json") -> None:
    """Start COMMAND and kill -9 every process of it once the first checkpoint holds MARK, the last file its save
    writes (Trainer's trainer_state.json; a sharded run's kha_run_state.json, after it)."""
    proc = subprocess.Popen(
        command, env=kha_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.time() + 600
    try:
        while time.time() < deadline and proc.poll() is None:
            if any(p.is_file() for p in out.parent.glob(f".kha-*.partial/checkpoint-{SAVE}/{mark}")):
                break
            time.sleep(0.02)
    finally:  # every process of the run, as a crashed node loses them (torchrun gives its ranks sessions of their own)
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not out.exists(), "the run finished before it was killed"


@pytest.fixture(scope="module")
def one_process(prepared, tmp_path_factory):
    """The reference: the run on 1 process with the whole global batch, uninterrupted."""
    out = tmp_path_factory.mktemp("one") / "full"
    kha_train(args(prepared, out, 1), None, out.parent)
    return out


def check_run_from_a_config(engine: str, proc, out, prepared, one_process, tmp_path) -> None:
    """What an uninterrupted 2-process run from a config must show (the module docstring)."""
    assert f"engine: {EXPECTED[engine]} on 2 process(es)" in proc.stdout  # what ran is what the config asked for
    assert "knocks at the start: identity on all 2 ranks; weight decay on knocks: [0.0]" in proc.stdout
    for line in ("; saved to ", "data: ", "learning rate "):  # the run's lines, once, not per rank
        assert proc.stdout.count(line) == 1, (line, proc.stdout[-2000:])
    losses, reference = logged_losses(out), logged_losses(one_process)
    assert sorted(losses) == list(range(1, STEPS + 1))
    if engine != "zero3":
        worst = max(abs(losses[s] - reference[s]) for s in losses)
        assert worst < ENGINE_TOLERANCE, {s: (losses[s], reference[s]) for s in losses}
    # the final save is the trained model: from_pretrained gives the loss the run measured on the held-out blocks
    reported = json.loads((out / "eval_results.json").read_text())["eval_loss"]
    assert abs(heldout_loss(out, prepared) - reported) < 1e-5
    assert json.loads((out / "kha_data.json").read_text())["seed"] == 0
    # nothing left beside or inside the output (an FSDP2 run from a config builds its weights in a `.kha-init-*`
    # folder of its working folder and removes it once every rank has loaded its shard)
    assert not list(tmp_path.glob(".kha-*")) and not list(out.glob(".kha-init-*"))
    # no foreign file: the code next to the weights is KHA's, as a plain save_pretrained writes it, under any engine
    assert {p.name for p in out.glob("*.py")} == {p.name for p in model_code_files()}


# ZeRO-2 resumes through the same DeepSpeed checkpoint load and Trainer data position as ZeRO-3, and FSDP2 with a FULL
# save through the same run state (training/run_state.py) as with a SHARDED one: their kills and resumes are the
# exhaustive tier (tests/conftest.py, KHA_EXHAUSTIVE=1); their uninterrupted runs always run
RESUMED_EXHAUSTIVELY = {"zero2", "fsdp2-full"}


@pytest.mark.parametrize("engine", [None, *engines(*ENGINES)])
def test_a_killed_run_resumes_exactly(engine, prepared, one_process, tmp_path):
    processes = 1 if engine is None else 2
    full = one_process
    if engine is not None:
        full = tmp_path / "full"
        proc = kha_train(args(prepared, full, processes), engine, tmp_path)
        check_run_from_a_config(engine, proc, full, prepared, one_process, tmp_path)
    if engine in RESUMED_EXHAUSTIVELY and not EXHAUSTIVE:
        return
    killed = tmp_path / "killed"
    kill_after_first_checkpoint(
        [*launcher(engine), "-m", "kha_hf", "train", *map(str, args(prepared, killed, processes))],
        tmp_path,
        killed,
        RUN_STATE_FILE if str(engine).startswith("fsdp") else "trainer_state.json",
    )
    proc = kha_train([*args(prepared, killed, processes), "--resume"], engine, tmp_path)
    assert "resuming the interrupted run" in proc.stdout
    assert "missing keys" not in proc.stderr, proc.stderr[-2000:]  # cpu-tiny's tied head is loaded, as its embedding
    # it continued from the checkpoint: a run that started over would log the same losses
    assert f"step {SAVE + 1}/{STEPS} " in proc.stdout and f"step 1/{STEPS} " not in proc.stdout, proc.stdout[-2000:]
    if engine is not None:
        assert f"engine: {EXPECTED[engine]} on 2 process(es)" in proc.stdout
    expected, resumed = logged_losses(full), logged_losses(killed)
    assert sorted(resumed) == list(range(1, STEPS + 1))  # every step logged once: none repeated, none skipped
    worst = max(abs(resumed[s] - expected[s]) for s in expected)
    assert worst < TOLERANCE, {
        s: (expected[s], resumed[s]) for s in expected if abs(resumed[s] - expected[s]) >= TOLERANCE
    }
    # the resumed run reports the whole run, as the uninterrupted one does (#69 item 5): its mean training loss
    summaries = [json.loads((out / "train_results.json").read_text()) for out in (full, killed)]
    assert abs(summaries[1]["train_loss"] - summaries[0]["train_loss"]) < 1e-6, summaries  # #69: 1e-6
    assert f"trained steps {SAVE + 1}-{STEPS} (resumed at step {SAVE})" in proc.stdout, proc.stdout[-2000:]


def test_resume_with_another_seed_or_corpus_is_refused(prepared, corpus, tmp_path):
    out = tmp_path / "run"
    base = [
        "cpu-tiny",
        "--data",
        prepared,
        "--mode",
        "full",
        "--max-steps",
        "4",
        "--save-steps",
        "2",
        "--batch-size",
        "4",
        *RUN,
        "--output",
        out,
    ]
    kha_train(base, None, tmp_path)
    proc = kha_train([*base, "--resume", "--seed", "1"], None, tmp_path, expect=2)
    assert proc.stderr.strip().splitlines()[-1].startswith("kha train: error: --resume with another seed")
    data, tokenizer = corpus
    tokenizer.save_pretrained(tmp_path / "tok")
    other = tmp_path / "other"
    tokenize_corpus([str(next(data.glob("*.md")))], tmp_path / "tok", other, workers=1, disable_tqdm=True)
    base[2] = other
    proc = kha_train([*base, "--resume"], None, tmp_path, expect=2)
    assert proc.stderr.strip().splitlines()[-1].startswith("kha train: error: --resume with another corpus")
