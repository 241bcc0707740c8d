"""`kill -9` a `kha train` run on a prepared corpus, then `--resume` it: it continues from its last checkpoint at the
exact data position (no block repeated, none skipped), and every logged loss equals an uninterrupted run's within
1e-5 (CPU, float32), on 1 process, on 2 (DDP) and on the sharding engines (ZeRO-2, ZeRO-3; FSDP2 with full and
sharded checkpoints, whose optimizer, scheduler and random states kha saves itself: training/run_state.py).
`--resume` with another seed or another corpus than the run it resumes is refused in one line."""

import os
import signal
import subprocess
import time

import psutil
import pytest

from kha_hf.data.prepare import tokenize_corpus
from kha_hf.training.run_state import RUN_STATE_FILE
from tests.training.engines import EXPECTED, RUN, engines, kha_env, kha_train, launcher, logged_losses

TOLERANCE = 1e-5
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


@pytest.mark.parametrize("engine", [None, *engines("ddp", "fsdp2-full", "fsdp2-sharded", "zero2", "zero3")])
def test_a_killed_run_resumes_exactly(engine, prepared, tmp_path):
    processes = 1 if engine is None else 2
    full = tmp_path / "full"
    kha_train(args(prepared, full, processes), engine, tmp_path)
    killed = tmp_path / "killed"
    kill_after_first_checkpoint(
        [*launcher(engine), "-m", "kha_hf", "train", *map(str, args(prepared, killed, processes))],
        tmp_path,
        killed,
        RUN_STATE_FILE if str(engine).startswith("fsdp") else "trainer_state.json",
    )
    proc = kha_train([*args(prepared, killed, processes), "--resume"], engine, tmp_path)
    assert "resuming the interrupted run" in proc.stdout
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
