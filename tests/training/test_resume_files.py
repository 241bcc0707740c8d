"""What `--resume` reads, checked before anything loads (training/resume_files.py; #70 items 1-4, 7, 8, 11).

One finished 1-process run of 4 steps (checkpoints 2 and 4) is copied and tampered with per case: a link or a FIFO
in its folder, a checkpoint without its optimizer, scheduler or weights, one whose save was interrupted, and
DeepSpeed-shaped states whose pickle would run code (DeepSpeed loads them with `weights_only=False`; the real
ZeRO-2 case, the payload in `mp_rank_00_model_states.pt` under `accelerate launch`, ran by hand: docs/safety.md).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import threading

import pytest
import torch

from kha_hf import __version__
from kha_hf.cli import main
from kha_hf.common.errors import KHAError
from kha_hf.training.resume_files import check_checkpoint_files
from tests.training.engines import RUN

STEPS = ["--mode", "full", "--batch-size", "2", "--save-steps", "2", *RUN]


class Payload:
    """A pickle that runs a command when loaded: it touches MARK."""

    def __init__(self, mark):
        self.mark = str(mark)

    def __reduce__(self):
        return (os.system, (f"touch {self.mark}",))


@pytest.fixture(scope="module")
def finished(prepared, tmp_path_factory):
    """A finished run of 4 steps, with checkpoint-2 and checkpoint-4."""
    out = tmp_path_factory.mktemp("finished") / "run"
    args = ["train", "cpu-tiny", "--data", str(prepared), *STEPS, "--max-steps", "4", "--output", str(out)]
    assert main(args) == 0
    return out


def resume(prepared, out, capsys, max_steps: int = 4, *extra: str) -> tuple[int, str]:
    capsys.readouterr()
    args = ["train", "cpu-tiny", "--data", str(prepared), *STEPS, "--max-steps", str(max_steps), "--output", str(out)]
    code = main([*args, "--resume", *extra])
    return code, capsys.readouterr().err.strip()


def copy_of(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out, symlinks=True)
    return out


def deepspeed_states(checkpoint, model_states) -> None:
    """CHECKPOINT made DeepSpeed-shaped: `latest` naming global_step4, MODEL_STATES pickled as its model states,
    and an optimizer state holding the plain data classes DeepSpeed 0.19 pickles."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    states = checkpoint / "global_step4"
    states.mkdir()
    (checkpoint / "latest").write_text("global_step4")
    torch.save(model_states, states / "mp_rank_00_model_states.pt")
    optimizer = {"loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum(2), "where": fragment_address(4, 0)}
    torch.save({**optimizer, "state": torch.zeros(4)}, states / "zero_pp_rank_0_mp_rank_00_optim_states.pt")


def test_deepspeed_states_that_would_run_code_are_refused_before_anything_loads(finished, prepared, tmp_path, capsys):
    out = copy_of(finished, tmp_path)
    mark = tmp_path / "ran"
    deepspeed_states(out / "checkpoint-4", {"module": Payload(mark)})
    code, err = resume(prepared, out, capsys, 6)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "DeepSpeed would unpickle mp_rank_00_model_states.pt, which names posix.system" in err
    assert "--trust-checkpoint-pickle" in err
    assert not mark.exists(), "the checkpoint's pickle ran"


def test_deepspeed_plain_data_states_pass_and_other_pickles_are_refused(finished, tmp_path):
    checkpoint = tmp_path / "checkpoint-4"
    shutil.copytree(finished / "checkpoint-4", checkpoint)
    deepspeed_states(checkpoint, {"module": {"w": torch.ones(2)}})
    check_checkpoint_files(checkpoint)  # DeepSpeed's own data classes beside tensors: what a real save holds
    # protocol 4 (STACK_GLOBAL, not torch.save's format): nothing that cannot be read without running it is loaded
    with open(checkpoint / "global_step4" / "mp_rank_00_model_states.pt", "wb") as f:
        pickle.dump({"module": Payload(tmp_path / "ran")}, f, protocol=4)
    with pytest.raises(KHAError, match="no pickle that can be read without running it"):
        check_checkpoint_files(checkpoint)
    check_checkpoint_files(checkpoint, trust_pickle=True)  # the opt-in: checked no further (nothing is loaded here)
    assert not (tmp_path / "ran").exists()
    (checkpoint / "latest").write_text("../../elsewhere")
    with pytest.raises(KHAError, match="not a folder of DeepSpeed's states inside checkpoint-4"):
        check_checkpoint_files(checkpoint)


def test_a_link_in_the_run_is_refused_and_nothing_is_written_through_it(finished, prepared, tmp_path, capsys):
    out = copy_of(finished, tmp_path)
    outside = tmp_path / "outside.jsonl"
    outside.write_text("kept\n")
    (out / "stability.jsonl").unlink()
    (out / "stability.jsonl").symlink_to(outside)
    code, err = resume(prepared, out, capsys, 6)
    assert code == 2 and err.splitlines() == [
        f"kha train: error: {out / 'stability.jsonl'} is a symbolic link: a resumed run reads and writes only the "
        "files it wrote itself"
    ]
    assert outside.read_text() == "kept\n"


def test_a_fifo_in_the_run_is_refused_without_blocking(finished, prepared, tmp_path, capsys):
    out = copy_of(finished, tmp_path)
    (out / "stability.jsonl").unlink()
    os.mkfifo(out / "stability.jsonl")
    result = {}

    def attempt():
        result["code"], result["err"] = resume(prepared, out, capsys, 6)

    worker = threading.Thread(target=attempt)
    worker.start()
    worker.join(120)
    if worker.is_alive():  # unblock it, then fail
        with open(out / "stability.jsonl", "w"):
            pass
        pytest.fail("--resume blocked on a FIFO")
    assert result["code"] == 2 and "is not a regular file (a FIFO, socket or device)" in result["err"], result


@pytest.mark.parametrize(
    "missing, said",
    [
        ("optimizer.pt", "has no optimizer.pt: resuming would start a fresh optimizer and schedule"),
        ("scheduler.pt", "has no scheduler.pt: resuming would start a fresh optimizer and schedule"),
        ("model.safetensors", "holds no model weights (model.safetensors): not a checkpoint to resume from"),
    ],
)
def test_a_checkpoint_missing_what_an_exact_resume_needs_is_one_line(
    finished, prepared, tmp_path, capsys, missing, said
):
    out = copy_of(finished, tmp_path)
    (out / "checkpoint-4" / missing).unlink()
    code, err = resume(prepared, out, capsys, 6)
    assert code == 2 and len(err.splitlines()) == 1 and said in err, err


def test_an_interrupted_save_resumes_from_the_checkpoint_before(finished, prepared, tmp_path, capsys):
    out = copy_of(finished, tmp_path)
    (out / "checkpoint-4" / "trainer_state.json").unlink()  # killed during its save: the last file never came
    capsys.readouterr()
    args = ["train", "cpu-tiny", "--data", str(prepared), *STEPS, "--max-steps", "4", "--output", str(out)]
    assert main([*args, "--resume"]) == 0
    printed = capsys.readouterr().out
    line = "checkpoint-4 is incomplete (no trainer_state.json: its save was interrupted); resuming from checkpoint-2"
    assert line in printed
    assert "step 3/4 " in printed and "step 1/4 " not in printed, printed[-2000:]
    assert "trained steps 3-4 (resumed at step 2)" in printed, printed[-2000:]


def test_resuming_a_finished_run_keeps_its_record_and_summarises_the_whole_run(finished, prepared, tmp_path, capsys):
    out = copy_of(finished, tmp_path)
    before = [json.loads(line) for line in (finished / "stability.jsonl").read_text().splitlines()]
    assert [r["step"] for r in before] == [1, 2, 3, 4]
    code, err = resume(prepared, out, capsys, 6)
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "stability.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # steps 1-4 kept, none twice
    assert rows[:4] == before  # resumed from checkpoint-4: nothing before it ran again
    summary = json.loads((out / "train_results.json").read_text())
    assert summary["max_grad_norm"] == max(r["grad_norm"] for r in rows)
    assert summary["train_loss"] == pytest.approx(sum(r["loss"] for r in rows) / 6, abs=1e-9)  # the run's 6 steps


def test_a_run_whose_record_was_removed_is_not_resumed_with_other_settings(finished, prepared, tmp_path, capsys):
    """#70 item 12: the marker names the version that wrote the run, so a missing kha_data.json is no older run."""
    out = copy_of(finished, tmp_path)
    (out / "kha_data.json").unlink()
    code, err = resume(prepared, out, capsys, 6, "--seq-len", "32")
    assert code == 2 and err.splitlines() == [
        f"kha train: error: {out / 'kha_data.json'} is missing: kha-hf {__version__} wrote this run with its record "
        "(corpus, seed, block length), which --resume checks; start a new run"
    ]


def test_a_refusal_under_accelerate_launch_is_one_line_of_kha(tmp_path):
    """Every rank runs the same checks and refuses alike; the first says it (#70): one `kha train: error:` line, then
    only what accelerate's launcher prints of its failed processes (not kha's to silence)."""
    import subprocess

    from tests.training.engines import kha_env, launcher

    proc = subprocess.run(
        [*launcher("ddp"), "-m", "kha_hf", "train", "cpu-smoke", "--mode", "full", "--output", str(tmp_path / "out"),
         "--resume"],
        capture_output=True, text=True, env=kha_env(tmp_path), timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0
    said = [line for line in proc.stderr.splitlines() if line.startswith("kha train: error:")]
    assert said == [f"kha train: error: nothing to resume: {tmp_path / 'out'} holds no checkpoint-N folders and no "
                    "interrupted run of it"], proc.stderr[-3000:]  # fmt: skip
    assert "Traceback" not in proc.stdout and not (tmp_path / "out").exists()


# ---- the attack round of 2026-12-07 (#70) ----------------------------------------------------------------------------


def test_a_planted_random_state_is_refused_on_every_rank_before_anything_loads(finished, prepared, tmp_path, capsys):
    """Each rank reads only its own rng_state_N.pth: rank 1's planted pickle was refused on rank 1 alone and rank 0
    died of the broken connection. Every rank now checks every rank's file first."""
    out = copy_of(finished, tmp_path)
    mark = tmp_path / "ran"
    torch.save({"python": Payload(mark)}, out / "checkpoint-4" / "rng_state_1.pth")
    code, err = resume(prepared, out, capsys, 6)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("kha train: error: cannot resume from checkpoint-4: rng_state_1.pth is no random state")
    assert not mark.exists()


def test_weights_whose_header_lies_are_one_line(finished, prepared, tmp_path, capsys):
    out = copy_of(finished, tmp_path)
    weights = out / "checkpoint-4" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    header = int.from_bytes(data[:8], "little")
    text = data[8 : 8 + header].decode().replace('"data_offsets":[0,', '"data_offsets":[1,', 1)
    data[8 : 8 + header] = text.encode()  # the same size: a tensor that no longer covers the file
    weights.write_bytes(bytes(data))
    code, err = resume(prepared, out, capsys, 6)
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "kha train: error: cannot" in err and "checkpoint-4" in err


def test_a_planted_giant_line_in_the_records_is_dropped_not_copied(finished, prepared, tmp_path, capsys):
    out = copy_of(finished, tmp_path)
    rows = (out / "stability.jsonl").read_text()
    with open(out / "stability.jsonl", "a") as f:  # 256 MiB without a newline (sparse: no disk)
        f.truncate(len(rows) + (256 << 20))
    code, err = resume(prepared, out, capsys, 6)
    assert code == 0, err
    kept = (out / "stability.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in kept] == [1, 2, 3, 4, 5, 6]
    assert (out / "stability.jsonl").stat().st_size < 1 << 20


def test_a_validation_record_keeps_finite_rows_once_in_order(tmp_path):
    from kha_hf.training.validation_log import read_validation_lines

    path = tmp_path / "validation.jsonl"
    path.write_text(
        '{"step": 2, "validation_loss": 5.5, "tokens_seen": 64}\n'
        '{"step": 4, "validation_loss": 1e999, "tokens_seen": 128}\n'  # Infinity: no JSON a reader could take
        '{"step": 4, "validation_loss": 5.1, "tokens_seen": 128}\n'
        '{"step": 3, "validation_loss": 5.2, "tokens_seen": 96}\n'  # out of order
        '{"step": 6, "validation_loss": "x", "tokens_seen": 192}\n' + "y" * 5000 + "\n"
        '{"step": 8, "validation_loss": null, "tokens_seen": 256}\n'
    )
    assert [(r["step"], r["validation_loss"]) for r in read_validation_lines(path)] == [(2, 5.5), (4, 5.1), (8, None)]


def test_a_second_resume_of_the_same_output_is_refused_while_the_first_runs(finished, prepared, tmp_path, capsys):
    from kha_hf.checkpoint.output import hold_lock

    out = copy_of(finished, tmp_path)
    held = hold_lock(out, "held")  # the first resume, still working
    try:
        code, err = resume(prepared, out, capsys, 6)
    finally:
        os.close(held)
    assert code == 2 and err == f"kha train: error: {out} is being resumed by another run"
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 4  # untouched


def test_the_ranks_of_one_launch_say_a_refusal_once_and_each_its_own(monkeypatch, tmp_path, capsys):
    import tempfile

    from kha_hf.cli import say_once

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "29511")
    say_once("kha train: error: the same")  # rank 0
    say_once("kha train: error: the same")  # rank 1: already said
    say_once("kha train: error: rank 1's own file")
    assert capsys.readouterr().err.splitlines() == ["kha train: error: the same", "kha train: error: rank 1's own file"]


def test_a_checkpoint_error_is_said_without_the_traceback_it_carries():
    from kha_hf.training.train import first_line

    err = RuntimeError(
        "CheckpointException ranks:dict_keys([0, 1])\nTraceback (most recent call last): (RANK 0)\n  File"
    )
    assert first_line(err) == "CheckpointException ranks:dict_keys([0, 1])"


def test_record_lines_are_read_in_bounded_pieces():
    import io

    from kha_hf.common.text_files import bounded_lines

    class Counting(io.BytesIO):
        largest = 0

        def readline(self, size=-1):
            line = super().readline(size)
            Counting.largest = max(Counting.largest, len(line))
            return line

    f = Counting(b'{"a": 1}\n' + b"x" * (8 << 20) + b"\n" + b'{"b": 2}\n' + b"z" * 100)
    assert list(bounded_lines(f, 4096)) == [b'{"a": 1}\n', b'{"b": 2}\n', b"z" * 100]
    assert Counting.largest <= 4097  # an 8 MiB line never held whole
