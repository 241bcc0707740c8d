"""Round 6's attack on the configs accelerate hands `kha train` (#58's last acceptance line): what got through.

- A DeepSpeed config's `flops_profiler.output_file` replaced a file outside the run; `csv_monitor` wrote logs
  outside it; `autotuning` wrote into the working directory and ended the run, and `kha train` exited 0 without a
  model; NVMe offload filled `nvme_path`; a FIFO as the config hung every rank; a file that is not JSON, or
  `elasticity`, was a traceback per rank.
- `--resume` followed a `checkpoint-N` that is a link out of the run, loading its weights and optimizer.
Each is one line now; the config checks run before anything reads the file (`kha train` under accelerate launch
reads it from ACCELERATE_DEEPSPEED_CONFIG_FILE, which these tests set as accelerate does).
"""

from __future__ import annotations

import json
import os

import pytest

from kha_hf.common.errors import KHAError
from kha_hf.training.deepspeed_config import check_deepspeed_config

ZERO2 = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}


def _config(tmp_path, **blocks):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**ZERO2, **blocks}))
    return path


@pytest.mark.parametrize(
    "blocks, match",
    [
        ({"flops_profiler": {"enabled": True, "output_file": "/tmp/victim.txt"}}, "enables flops_profiler"),
        ({"csv_monitor": {"enabled": True, "output_path": "/tmp/elsewhere"}}, "enables csv_monitor"),
        ({"tensorboard": {"enabled": True, "output_path": "/tmp/elsewhere"}}, "enables tensorboard"),
        ({"wandb": {"enabled": True}}, "enables wandb"),
        ({"comet": {"enabled": True}}, "enables comet"),
        ({"autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 2}}, "enables autotuning"),
        ({"elasticity": {"enabled": True, "max_train_batch_size": 8}}, "enables elasticity"),
        ({"compression_training": {"weight_quantization": {}}}, "enables compression_training"),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp/x"}}},
            "offloads to NVMe",
        ),
    ],
)
def test_blocks_that_write_elsewhere_or_end_the_run_are_refused(tmp_path, blocks, match):
    with pytest.raises(KHAError, match=match) as refused:
        check_deepspeed_config(_config(tmp_path, **blocks))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "blocks, said",
    [  # #70 item 10: DeepSpeed itself rejects these, once per rank, after kha's check had passed them
        ({"curriculum_learning": {"enabled": True}}, "Legacy top-level 'curriculum_learning' has been removed"),
        ({"zero_optimization": {"stage": 7}}, "validation error for DeepSpeedZeroConfig"),
    ],
)
def test_a_config_deepspeed_itself_refuses_is_one_line(tmp_path, blocks, said):
    with pytest.raises(KHAError, match="is one DeepSpeed refuses") as refused:
        check_deepspeed_config(_config(tmp_path, **blocks))
    assert said in str(refused.value) and "\n" not in str(refused.value)


def test_what_transformers_fills_in_passes(tmp_path):
    """The "auto" values of transformers' DeepSpeed examples are left to it."""
    autos = {
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"},
    }
    check_deepspeed_config(_config(tmp_path, **autos))


def test_a_plain_config_and_disabled_blocks_pass(tmp_path):
    check_deepspeed_config(_config(tmp_path))
    check_deepspeed_config(_config(tmp_path, flops_profiler={"enabled": False}, tensorboard={"enabled": False}))
    check_deepspeed_config(_config(tmp_path, zero_optimization={"stage": 3, "offload_param": {"device": "cpu"}}))


def test_nvme_offload_in_the_accelerate_yaml_is_refused(monkeypatch):
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "nvme")
    with pytest.raises(KHAError, match="offload_param_device: nvme"):
        check_deepspeed_config()


def test_a_fifo_or_a_file_that_is_not_json_is_one_line(tmp_path):
    os.mkfifo(tmp_path / "fifo.json")
    with pytest.raises(KHAError, match="not a regular file"):
        check_deepspeed_config(tmp_path / "fifo.json")
    (tmp_path / "bad.json").write_text("{ not json")
    with pytest.raises(KHAError, match="is not valid JSON"):
        check_deepspeed_config(tmp_path / "bad.json")


def test_kha_train_checks_the_config_accelerate_hands_it(tmp_path, monkeypatch, capsys):
    """As accelerate launch sets it for every rank; refused before any model is built or file written."""
    from kha_hf.cli import main
    from tests.helpers import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path / "kha", "llama", knock="linear_qkv")
    capsys.readouterr()
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(_config(tmp_path, autotuning={"enabled": True})))
    rc = main(["train", str(tmp_path / "kha"), "--max-steps", "2", "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "enables autotuning" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".kha-")]


def test_a_library_that_calls_exit_inside_training_is_no_success(tmp_path, monkeypatch, capsys):
    """DeepSpeed's autotuning calls exit() after its profile steps: `kha train` exited 0 without a model."""
    from kha_hf.cli import main
    from kha_hf.training import trainer as trainer_module
    from tests.helpers import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path / "kha", "llama", knock="linear_qkv")

    def exits(self, *args, **kwargs):
        raise SystemExit(0)

    monkeypatch.setattr(trainer_module.KHATrainer, "train", exits)
    rc = main(["train", str(tmp_path / "kha"), "--max-steps", "2", "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and "training stopped before its last step" in err, err
    assert not (tmp_path / "out").exists()


def test_resume_refuses_a_checkpoint_that_links_out_of_the_run(tmp_path):
    from kha_hf.training.train import check_checkpoint_step

    elsewhere = tmp_path / "elsewhere" / "checkpoint-2"
    elsewhere.mkdir(parents=True)
    (elsewhere / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint-2").symlink_to(elsewhere)
    with pytest.raises(KHAError, match="is a symbolic link"):
        check_checkpoint_step(str(run / "checkpoint-2"), max_steps=3)
