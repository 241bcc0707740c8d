"""Which checkpoint `--resume` continues from under a sharded layout (training/run_state.py), decided before anything
loads: the newest complete one (its kha_run_state.json written last), saved under the same layout; a checkpoint of a
sharded run is never resumed by another engine, and one of another launch is refused in one line."""

import json

import pytest

from kha_hf.common.errors import KHAError
from kha_hf.training.parallel import ParallelPlan
from kha_hf.training.run_state import FORMAT, RUN_STATE_FILE, check_resumed_layout

PLAN = ParallelPlan(2, fsdp_size=2)


def checkpoint(run, step: int, layout: dict | None) -> str:
    folder = run / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if layout is not None:
        record = {"format": FORMAT, "layout": layout, "optimizer": {}, "scheduler": {}}
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
    last = checkpoint(tmp_path, 4, None)  # DDP's checkpoint: optimizer.pt, no run state
    with pytest.raises(KHAError, match="nothing to resume under this layout"):
        check_resumed_layout(tmp_path, last, PLAN)
    assert check_resumed_layout(tmp_path, last, None) == last  # its own engine resumes it as before


def test_a_run_state_that_is_a_link_does_not_count(tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"format": FORMAT, "layout": PLAN.layout(), "optimizer": {}, "scheduler": {}}))
    last = checkpoint(tmp_path / "run", 4, None)
    (tmp_path / "run" / "checkpoint-4" / RUN_STATE_FILE).symlink_to(target)
    with pytest.raises(KHAError, match="nothing to resume"):
        check_resumed_layout(tmp_path / "run", last, PLAN)


@pytest.mark.parametrize("kind", ["fifo", "link"])
def test_a_fifo_or_link_in_the_checkpoint_is_refused(kind, tmp_path):
    import os

    last = checkpoint(tmp_path / "run", 4, PLAN.layout())
    (tmp_path / "run" / "checkpoint-4" / "optimizer").mkdir()
    shard = tmp_path / "run" / "checkpoint-4" / "optimizer" / "shard-00001-model-00001-of-00001.safetensors"
    if kind == "fifo":
        os.mkfifo(shard)  # read by every rank: it would block them all
    else:
        (tmp_path / "elsewhere.safetensors").write_bytes(b"x")
        shard.symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(KHAError, match="a run resumes from checkpoints it wrote itself"):
        check_resumed_layout(tmp_path / "run", last, PLAN)
