"""Which checkpoint `--resume` continues from under a sharded layout (training/run_state.py), decided before anything
loads: the newest complete one (its kha_run_state.json written last), saved under the same layout; a checkpoint of a
sharded run is never resumed by another engine, and one of another launch is refused in one line."""

import json
from pathlib import Path

import pytest

from kha_hf.common.errors import KHAError
from kha_hf.training.parallel import ParallelPlan, check_plan_fits
from kha_hf.training.resume_files import last_complete_checkpoint
from kha_hf.training.run_state import (
    FORMAT,
    OPTIMIZER_DIR,
    RUN_STATE_FILE,
    _restored,
    _write_no_follow,
    check_resumed_layout,
    weight_files,
)

PLAN = ParallelPlan(2, fsdp_size=2)


def checkpoint(run, step: int, layout: dict | None) -> str:
    """A checkpoint-STEP of a sharded run as kha writes it: two model shards, an optimizer shard, and (LAYOUT given)
    the run state recording them, written last."""
    folder = run / f"checkpoint-{step}"
    (folder / OPTIMIZER_DIR).mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    for name in ("shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"):
        (folder / name).write_bytes(b"w" * 64)
    (folder / OPTIMIZER_DIR / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"o" * 32)
    if layout is not None:
        files = weight_files(folder)
        record = {"format": FORMAT, "layout": layout, "optimizer": {}, "scheduler": {}, "files": files}
        (folder / RUN_STATE_FILE).write_text(json.dumps(record))
    return str(folder)


def test_the_newest_complete_checkpoint_is_resumed(tmp_path):
    checkpoint(tmp_path, 4, PLAN.layout())
    newest = checkpoint(tmp_path, 8, None)  # a kill during its save: no run state yet
    assert check_resumed_layout(tmp_path, newest, PLAN) == str(tmp_path / "checkpoint-4")


def test_another_world_size_or_layout_is_refused(tmp_path):
    other = ParallelPlan(4, fsdp_size=4).layout()
    last = checkpoint(tmp_path, 4, other)
    with pytest.raises(KHAError, match="resume with the same launch") as refused:
        check_resumed_layout(tmp_path, last, PLAN)
    assert "'world_size': 4" in str(refused.value) and "\n" not in str(refused.value)


def test_a_sharded_runs_checkpoint_is_not_resumed_by_another_engine(tmp_path):
    last = checkpoint(tmp_path, 4, PLAN.layout())
    with pytest.raises(KHAError, match="sharded at load time"):
        check_resumed_layout(tmp_path, last, None)  # DDP / DeepSpeed / 1 process: Trainer finds no optimizer.pt


def test_a_run_of_another_engine_is_not_resumed_sharded(tmp_path):
    last = tmp_path / "checkpoint-4"  # DDP's checkpoint: optimizer.pt, no run state
    last.mkdir()
    (last / "optimizer.pt").write_bytes(b"")
    last = str(last)
    with pytest.raises(KHAError, match="nothing to resume under this layout"):
        check_resumed_layout(tmp_path, last, PLAN)
    assert check_resumed_layout(tmp_path, last, None) == last  # its own engine resumes it as before


def test_a_run_state_that_is_a_link_does_not_count(tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"format": FORMAT, "layout": PLAN.layout(), "optimizer": {}, "scheduler": {}}))
    last = checkpoint(tmp_path / "run", 4, None)
    (tmp_path / "run" / "checkpoint-4" / RUN_STATE_FILE).symlink_to(target)
    with pytest.raises(KHAError, match="kha_run_state.json is a symbolic link"):  # refused, never taken for one
        check_resumed_layout(tmp_path / "run", last, PLAN)
    assert last_complete_checkpoint(tmp_path / "run", RUN_STATE_FILE) is None  # and never counted as complete


@pytest.mark.parametrize("kind", ["fifo", "link"])
def test_a_fifo_or_link_in_the_checkpoint_is_refused(kind, tmp_path):
    import os

    last = checkpoint(tmp_path / "run", 4, PLAN.layout())
    shard = tmp_path / "run" / "checkpoint-4" / "optimizer" / "shard-00001-model-00001-of-00001.safetensors"
    shard.unlink()
    if kind == "fifo":
        os.mkfifo(shard)  # read by every rank: it would block them all
    else:
        (tmp_path / "elsewhere.safetensors").write_bytes(b"x")
        shard.symlink_to(tmp_path / "elsewhere.safetensors")
    said = "is a symbolic link: a resumed run reads" if kind == "link" else r"is not a regular file \(a FIFO"
    with pytest.raises(KHAError, match=said):
        check_resumed_layout(tmp_path / "run", last, PLAN)


def test_an_unfinished_sharded_checkpoint_is_not_resumed_by_another_engine(tmp_path):
    """A kill between Trainer's files and the run state leaves optimizer/ without kha_run_state.json: 1 process or
    DDP would find no optimizer.pt and restart the optimizer and its warmup without a word (the attack's F7)."""
    last = checkpoint(tmp_path, 4, None)
    with pytest.raises(KHAError, match="sharded at load time"):
        check_resumed_layout(tmp_path, last, None)


@pytest.mark.parametrize("change", ["missing", "extra", "truncated"])
def test_shards_that_differ_from_the_record_are_refused(change, tmp_path):
    """torch's safetensors reader builds a checkpoint from whatever files are there: a missing model shard resumed
    on uninitialised memory, an extra one was merged in (the attack's F5)."""
    last = Path(checkpoint(tmp_path, 4, PLAN.layout()))
    shard = last / "shard-00001-model-00001-of-00001.safetensors"
    if change == "missing":
        shard.unlink()
    elif change == "extra":
        (last / OPTIMIZER_DIR / "zz-foreign.safetensors").write_bytes(b"x")
    else:
        shard.write_bytes(b"w" * 10)
    with pytest.raises(KHAError, match="not those its run state records"):
        check_resumed_layout(tmp_path, str(last), PLAN)


def test_a_link_in_the_run_folder_is_refused(tmp_path):
    checkpoint(tmp_path / "run", 4, PLAN.layout())
    (tmp_path / "victim").mkdir()
    (tmp_path / "run" / "checkpoint-6").symlink_to(tmp_path / "victim")  # the next save would write there
    with pytest.raises(KHAError, match="is a symbolic link"):
        check_resumed_layout(tmp_path / "run", None, PLAN)


def test_the_run_state_is_written_in_place_of_a_link_not_through_it(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("ORIGINAL")
    (tmp_path / "state.tmp").symlink_to(victim)
    _write_no_follow(tmp_path / "state.tmp", "{}")
    assert victim.read_text() == "ORIGINAL" and not (tmp_path / "state.tmp").is_symlink()


def test_a_step_in_other_digits_is_not_a_checkpoint(tmp_path):
    checkpoint(tmp_path, 4, PLAN.layout())
    (tmp_path / "checkpoint-\u00b2").mkdir()
    (tmp_path / "checkpoint-\u00b2" / RUN_STATE_FILE).write_text("{}")
    assert last_complete_checkpoint(tmp_path, RUN_STATE_FILE) == str(tmp_path / "checkpoint-4")


@pytest.mark.parametrize(
    "saved, current",
    [("abc", 1e-3), ("nan", 1e-3), (float("inf"), 1e-3), (True, 1e-3), ([0.9], (0.9, 0.95)), ("x", 3), ([], {})],
)
def test_values_a_run_cannot_take_are_refused(saved, current):
    with pytest.raises(KHAError, match="not a value this run can take"):
        _restored(saved, current, "optimizer lr")


def test_values_of_the_right_kind_are_restored():
    assert _restored([0.8, 0.9], (0.9, 0.95), "betas") == (0.8, 0.9)
    assert _restored(3, 1e-3, "lr") == 3.0 and isinstance(_restored(3, 1e-3, "lr"), float)
    assert _restored(None, None, "fused") is None and _restored(7, 5, "last_epoch") == 7


@pytest.mark.parametrize(
    "config, message",
    [
        ({"model_type": "qwen3", "hidden_size": 64}, "this one has none"),
        ({"model_type": "qwen3_moe", "num_experts": 3}, "does not divide the model's 3 experts"),
    ],
)
def test_expert_parallelism_the_model_cannot_take_is_refused(config, message):
    with pytest.raises(KHAError, match=message):
        check_plan_fits(ParallelPlan(2, fsdp_size=2, ep_size=2), config)
    check_plan_fits(ParallelPlan(2, fsdp_size=2, ep_size=2), {"model_type": "qwen3_moe", "num_experts": 4})
