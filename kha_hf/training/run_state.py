"""What a run sharded at load time (training/parallel.py) saves inside Trainer's `checkpoint-N/` so that `--resume`
continues exactly, and reads back: Trainer checkpoints no optimizer of such a model (transformers 5.25 refuses
unless `save_only_model`), so kha saves it.

    checkpoint-N/
      model.safetensors | shard-*-model-*.safetensors   the weights (FULL or SHARDED), written by Trainer / kha
      rng_state_<rank>.pth                              every rank's random state (Trainer's own file and format)
      optimizer/shard-*.safetensors                     the optimizer's tensors, each rank its shard (torch DCP)
      kha_run_state.json                                written last: the mark of a complete checkpoint

The optimizer goes through torch's distributed checkpoint (DCP) with its Hugging Face storage (safetensors, no
pickle: DCP's default `.metadata` file is read with `pickle.load`). Its other entries (each group's lr, betas, weight
decay ...) and the scheduler's state are JSON in `kha_run_state.json`, with the world size and layout they were saved
under. The data position is the step: a prepared corpus's order is one global order from the seed
(data/order.py), which Trainer's resume skips to.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from ..common.errors import KHAError

RUN_STATE_FILE = "kha_run_state.json"
OPTIMIZER_DIR = "optimizer"
FORMAT = 1
MAX_RECORD = 64 << 20  # the optimizer's settings are kept per parameter: a few hundred bytes each


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # fully qualified parameter names as keys: independent of how the optimizer grouped its parameters
    return StateDictOptions(flatten_optimizer_state_dict=True)


def _split(state: dict) -> tuple[dict, dict]:
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    return tensors, {k: v for k, v in state.items() if k not in tensors}


def _json_value(value):
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # JSON has no inf / nan: kept as text, read back by float()
    return list(value) if isinstance(value, tuple) else value


def save_run_state(model, optimizer, scheduler, folder: Path, layout: dict, is_main: bool) -> None:
    """Save OPTIMIZER's state (collective: every rank calls it) and SCHEDULER's into FOLDER; the main process writes
    RUN_STATE_FILE last."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    tensors, others = _split(get_optimizer_state_dict(model, optimizer, options=_options()))
    shards = str(folder / OPTIMIZER_DIR)
    writer = HuggingFaceStorageWriter(path=shards, save_distributed=True, enable_consolidation=False)
    dcp.save(tensors, storage_writer=writer)
    dist.barrier()  # every rank's shard is written before the mark
    if is_main:
        record = {
            "format": FORMAT,
            "layout": layout,
            "files": weight_files(folder),  # every safetensors file of the checkpoint and its size, checked on resume
            "optimizer": {k: _json_value(v) for k, v in others.items()},
            "scheduler": {k: [_json_value(x) for x in v] if isinstance(v, list) else _json_value(v)
                          for k, v in scheduler.state_dict().items()},
        }  # fmt: skip
        _write_no_follow(folder / (RUN_STATE_FILE + ".tmp"), json.dumps(record, indent=1, sort_keys=True))
        os.replace(folder / (RUN_STATE_FILE + ".tmp"), folder / RUN_STATE_FILE)
    dist.barrier()


def _write_no_follow(path: Path, text: str) -> None:
    """Write PATH anew: a link (or anything) already there is removed, never followed out of the run's folder."""
    if path.is_symlink() or path.exists():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def weight_files(folder: Path) -> dict[str, int]:
    """FOLDER's safetensors files and its optimizer's (relative name -> bytes): torch's safetensors reader builds a
    checkpoint from whichever files are there, so a missing shard would leave part of a tensor unread and an extra
    one would be merged in; the run state records them and a resume checks them."""
    found = {}
    for path in [*folder.glob("*.safetensors"), *(folder / OPTIMIZER_DIR).glob("*.safetensors")]:
        found[str(path.relative_to(folder))] = path.lstat().st_size
    return dict(sorted(found.items()))


def save_sharded_model(model, folder: Path, is_main: bool) -> None:
    """A SHARDED_STATE_DICT checkpoint's weights: each rank writes its shard (torch DCP, safetensors), as transformers
    5.25's `save_pretrained(distributed_checkpoint=True)` does, and `from_pretrained(folder, distributed_config=...)`
    reads them back. Collective. Workaround for 5.25: it hands DCP both names of a tied weight as one tensor, which
    safetensors refuses ("Some tensors share memory") once the model was itself loaded from such a checkpoint (a
    resumed run); here the tied name gets a copy of its shard (vocab x hidden / N more bytes a rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from transformers.distributed.checkpoint import _redistribute_state_dict

    state = _redistribute_state_dict(get_model_state_dict(model))
    for name in getattr(model, "all_tied_weights_keys", None) or {}:
        if name in state:
            state[name] = state[name].clone()
    writer = HuggingFaceStorageWriter(path=str(folder), save_distributed=True, enable_consolidation=False)
    dcp.save(state, storage_writer=writer)
    if is_main:
        model.config.save_pretrained(folder)
        if model.can_generate() and getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(folder)
    import torch.distributed as dist

    dist.barrier()


def read_run_state(folder: Path, layout: dict) -> dict:
    """FOLDER's run state, checked: one-line KHAError for a checkpoint without it (not written by a sharded run, or
    cut by a kill) or saved under another layout (its shards and per-rank random states would not fit)."""
    from ..common.text_files import read_json_object

    path = folder / RUN_STATE_FILE
    if path.is_symlink() or not path.is_file():
        raise KHAError(f"{folder} has no {RUN_STATE_FILE}: not a complete checkpoint of a sharded run")
    record = read_json_object(path, MAX_RECORD)
    kinds = {"optimizer": dict, "scheduler": dict, "files": dict}
    if record.get("format") != FORMAT or any(not isinstance(record.get(k), t) for k, t in kinds.items()):
        raise KHAError(f"{path}: not a run state kha wrote (format {record.get('format')!r})")
    if record.get("layout") != layout:
        raise KHAError(
            f"{folder.name} was saved by a run laid out as {record.get('layout')}, this one is {layout}: resume with "
            "the same launch (processes and layout)"
        )
    return record


def _restored(saved, current, what: str):
    """SAVED (read from JSON) as a value of CURRENT's kind: a finite number for a number, a bool for a bool, a list
    of as many for a list or tuple, None for None; one-line KHAError otherwise (a tampered or foreign run state)."""

    def number(x) -> bool:
        if isinstance(x, str):  # non-finite floats are kept as text (_json_value)
            return False
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    if current is None or isinstance(current, str):
        ok = saved is None or isinstance(saved, str)
    elif isinstance(current, bool):
        ok = isinstance(saved, bool)
    elif isinstance(current, int):
        ok = isinstance(saved, int) and not isinstance(saved, bool)
    elif isinstance(current, float):
        ok = number(saved)
    elif isinstance(current, (list, tuple)):
        ok = isinstance(saved, list) and len(saved) == len(current)
        if ok:
            return type(current)(_restored(s, c, what) for s, c in zip(saved, current, strict=True))
    elif isinstance(current, dict):
        ok = isinstance(saved, dict) and set(saved) <= set(current)
        if ok:
            return {**current, **{k: _restored(v, current[k], what) for k, v in saved.items()}}
    else:
        ok = False
    if not ok:
        raise KHAError(f"{what}: {str(saved)[:40]!r} is not a value this run can take (a changed run state)")
    return float(saved) if isinstance(current, float) else saved


def load_run_state(model, optimizer, scheduler, folder: Path, layout: dict) -> None:
    """Restore OPTIMIZER and SCHEDULER from FOLDER (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    record = read_run_state(folder, layout)
    shards = folder / OPTIMIZER_DIR
    if shards.is_symlink() or not shards.is_dir():
        raise KHAError(f"{folder} has no {OPTIMIZER_DIR}/ folder: not a complete checkpoint of a sharded run")
    current = get_optimizer_state_dict(model, optimizer, options=_options())
    tensors, others = _split(current)
    if set(others) != set(record["optimizer"]):
        raise KHAError(f"{folder.name}: its optimizer holds other parameters than this model's")
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(shards)))
    except (Exception, CheckpointException) as err:  # torch 2.13's CheckpointException is a BaseException
        raise KHAError(f"cannot read the optimizer of {folder.name}: {str(err).splitlines()[0][:300]}") from None
    for key, saved in record["optimizer"].items():
        others[key] = _restored(saved, others[key], f"{folder.name}: optimizer {key}")
    scheduler_state = scheduler.state_dict()
    if not set(record["scheduler"]) <= set(scheduler_state):
        raise KHAError(f"{folder.name}: its scheduler is not this run's (keys {sorted(record['scheduler'])[:5]})")
    for key, saved in record["scheduler"].items():
        scheduler_state[key] = _restored(saved, scheduler_state[key], f"{folder.name}: scheduler {key}")
    set_optimizer_state_dict(model, optimizer, {**tensors, **others}, options=_options())
    scheduler.load_state_dict(scheduler_state)


def check_resumed_layout(run_folder: Path, checkpoint: str | None, plan) -> str | None:
    """The checkpoint a `--resume` continues from, checked before anything loads. Under a sharded layout (PLAN): the
    newest complete one, saved under the same layout (one-line KHAError otherwise: its shards and per-rank random
    states would not fit another); without one: CHECKPOINT, unless a sharded run wrote it (it holds no optimizer
    Trainer could read)."""
    from .resume_files import check_run_entries, last_complete_checkpoint

    run_folder = Path(run_folder)
    if plan is None:
        sharded = [
            c for c in run_folder.glob("checkpoint-*")
            if (c / RUN_STATE_FILE).exists() or (c / OPTIMIZER_DIR).exists()
        ]  # fmt: skip
        if checkpoint is not None and sharded:  # an unfinished one too: its optimizer would silently start anew
            layout = read_json_layout(max(sharded, key=lambda c: c.stat().st_mtime))
            raise KHAError(
                f"{run_folder.name} was trained by a run sharded at load time ({layout}): resume it with the same "
                "launch (accelerate config, processes, --tp-size / --ep-size)"
            )
        return checkpoint
    # no link or FIFO anywhere in the run: a link would load state from elsewhere (or write a later checkpoint
    # there), a FIFO would block every rank
    check_run_entries(run_folder)
    complete = last_complete_checkpoint(run_folder, RUN_STATE_FILE)
    if complete is None:
        raise KHAError(
            f"nothing to resume under this layout: {run_folder} holds no checkpoint-N that a sharded run completed "
            f"({RUN_STATE_FILE}); a run of another engine resumes with its own launch"
        )
    record = read_run_state(Path(complete), plan.layout())
    if weight_files(Path(complete)) != record["files"]:
        raise KHAError(
            f"{Path(complete).name}: its safetensors files are not those its run state records (a shard missing, "
            "added or changed in size): not a checkpoint to resume from"
        )
    return complete


def read_json_layout(folder: Path):
    from ..common.text_files import read_json_object

    try:
        return read_json_object(folder / RUN_STATE_FILE, MAX_RECORD).get("layout")
    except (KHAError, OSError):
        return "an unfinished checkpoint"
