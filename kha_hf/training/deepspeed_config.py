"""The DeepSpeed config accelerate hands `kha train` (`deepspeed_config_file` in an accelerate config), checked before
anything reads it.

accelerate (1.13 to 1.16) passes the file's path to every rank in `ACCELERATE_DEEPSPEED_CONFIG_FILE`, and DeepSpeed
(0.19) acts on every block in it. Some blocks write where the run was not asked to write, or end the run:

- `flops_profiler.output_file` replaced any file it named (`victim.txt` became the profile report);
- `csv_monitor`, `tensorboard`, `wandb`, `comet` write logs wherever `output_path` says (or fail without their
  package, a traceback per rank);
- `autotuning` writes `autotuning_metric.json` into the working directory and calls `exit()` after its profile
  steps: `kha train` exited 0 without a model;
- NVMe offload (`offload_optimizer` / `offload_param` with `device: nvme`) fills `nvme_path` with swap files, then
  fails on CPUs without the async_io op;
- `elasticity` and `compression_training` change the batch and the model in ways a KHA run does not expect.

Refused in one line each; the file itself must be a regular file of JSON (a FIFO hung every rank).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..common.errors import KHAError
from ..common.text_files import read_json_object

ENV = "ACCELERATE_DEEPSPEED_CONFIG_FILE"
WRITES_ELSEWHERE = ("flops_profiler", "csv_monitor", "tensorboard", "wandb", "comet", "autotuning")
CHANGES_THE_RUN = ("elasticity", "compression_training")


def _enabled(block) -> bool:
    return isinstance(block, dict) and bool(block.get("enabled", False))


def check_deepspeed_config(path: str | Path | None = None) -> None:
    """One-line KHAError for the DeepSpeed config at PATH (default: what accelerate hands this process) that is not a
    regular JSON file, or that enables a block of WRITES_ELSEWHERE or CHANGES_THE_RUN, or NVMe offload."""
    if path is None:  # the accelerate yaml's own offload fields (`offload_optimizer_device: nvme`) come as variables
        for name in ("OPTIMIZER", "PARAM"):
            if os.environ.get(f"ACCELERATE_DEEPSPEED_OFFLOAD_{name}_DEVICE", "").lower() == "nvme":
                raise KHAError(
                    f"the accelerate config offloads to NVMe (offload_{name.lower()}_device: nvme), which writes swap "
                    "files outside --output: offload to cpu, or none"
                )
    path = path if path is not None else os.environ.get(ENV)
    if not path or str(path).lower() in ("none", ""):
        return
    path = Path(path)
    if not path.is_file():  # is_file follows a link: a link to a regular file is read as that file
        raise KHAError(f"the DeepSpeed config {path} is not a regular file (a FIFO, device or missing file)")
    config = read_json_object(path)
    for name in WRITES_ELSEWHERE:
        if _enabled(config.get(name)):
            raise KHAError(
                f"the DeepSpeed config {path} enables {name}, which writes outside --output (or ends the run): kha "
                "train logs to --output itself; remove the block"
            )
    for name in CHANGES_THE_RUN:
        if _enabled(config.get(name)) or (name == "compression_training" and config.get(name)):
            raise KHAError(f"the DeepSpeed config {path} enables {name}, which kha train does not run: remove it")
    zero = config.get("zero_optimization")
    for offload in ("offload_optimizer", "offload_param"):
        block = zero.get(offload) if isinstance(zero, dict) else None
        if isinstance(block, dict) and str(block.get("device", "")).lower() == "nvme":
            raise KHAError(
                f"the DeepSpeed config {path} offloads to NVMe ({offload}.nvme_path), which writes swap files outside "
                "--output: offload to cpu, or none"
            )
    check_with_deepspeed(path, config)


def check_with_deepspeed(path: Path, config: dict) -> None:
    """DeepSpeed's own parse of CONFIG (`DeepSpeedConfig`, deepspeed 0.19), before any rank starts: what it rejects
    (a legacy top-level `curriculum_learning` block, a field out of its range) is one line here, not a traceback per
    rank and the launcher's. The batch sizes that transformers fills in ("auto") are set to 1 for the parse; a field
    left "auto" that DeepSpeed's models reject is transformers' to fill, never refused here."""
    try:
        from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
        from pydantic import ValidationError
    except ImportError:  # no DeepSpeed here: the launch cannot run it either, and says so itself
        return
    parsed = dict(config)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if parsed.get(key) == "auto":
            parsed[key] = 1
    if parsed.get("train_batch_size") == "auto":
        del parsed["train_batch_size"]
    try:
        DeepSpeedConfig(parsed)
    except ValidationError as err:
        if any(error.get("input") == "auto" for error in err.errors()):
            return
        reason = " ".join(str(err).split())
    except (DeepSpeedConfigError, ValueError, TypeError, KeyError, AssertionError) as err:
        reason = " ".join(str(err).split()) or type(err).__name__
    else:
        return
    raise KHAError(f"the DeepSpeed config {path} is one DeepSpeed refuses: {reason[:300]}")


class _NoCpuNotice:
    """logging filter: drops DeepSpeed's "Setting accelerator to CPU" notice (deepspeed 0.19). accelerate 1.13 imports
    DeepSpeed whenever it is installed (`extract_model_from_parallel`, on every Trainer), so a run that uses no
    DeepSpeed printed it too; on a machine with no accelerator, CPU is what the run means."""

    def filter(self, record) -> bool:
        return not str(record.msg).startswith("Setting accelerator to CPU")


def quiet_deepspeed_cpu_notice() -> None:
    """Add the filter once to DeepSpeed's logger (by name: DeepSpeed need not be imported, or installed)."""
    import logging

    logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _NoCpuNotice) for f in logger.filters):
        logger.addFilter(_NoCpuNotice())
