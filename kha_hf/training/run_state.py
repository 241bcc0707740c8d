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
            "optimizer": {k: _json_value(v) for k, v in others.items()},
            "scheduler": {k: [_json_value(x) for x in v] if isinstance(v, list) else _json_value(v)
                          for k, v in scheduler.state_dict().items()},
        }  # fmt: skip
        tmp = folder / (RUN_STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
        os.replace(tmp, folder / RUN_STATE_FILE)
    dist.barrier()


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
    record = read_json_object(path)
    if record.get("format") != FORMAT or not isinstance(record.get("optimizer"), dict):
        raise KHAError(f"{path}: not a run state kha wrote (format {record.get('format')!r})")
    if record.get("layout") != layout:
        raise KHAError(
            f"{folder.name} was saved by a run laid out as {record.get('layout')}, this one is {layout}: resume with "
            "the same launch (processes and layout)"
        )
    return record


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
    try:
        dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(shards)))
    except Exception as err:  # DCP raises a CheckpointException carrying each rank's error
        raise KHAError(f"cannot read the optimizer of {folder.name}: {str(err).splitlines()[0][:300]}") from None
    for key, saved in record["optimizer"].items():
        value = others[key]
        others[key] = type(value)(saved) if isinstance(value, (tuple, float)) and saved is not None else saved
    set_optimizer_state_dict(model, optimizer, {**tensors, **others}, options=_options())
    scheduler_state = scheduler.state_dict()
    for key, saved in record["scheduler"].items():
        if key in scheduler_state:
            scheduler_state[key] = saved
    scheduler.load_state_dict(scheduler_state)


def last_complete_checkpoint(run_folder: Path) -> str | None:
    """The newest `checkpoint-N` of RUN_FOLDER whose run state was written (the last file a checkpoint gets): a kill
    during a save leaves the newest one without it, and the run continues from the one before."""
    steps = []
    for folder in Path(run_folder).glob("checkpoint-*"):
        step = folder.name.removeprefix("checkpoint-")
        mark = folder / RUN_STATE_FILE
        if step.isdigit() and not folder.is_symlink() and not mark.is_symlink() and mark.is_file():
            steps.append((int(step), folder))
    return str(max(steps)[1]) if steps else None


def check_resumed_layout(run_folder: Path, checkpoint: str | None, plan) -> str | None:
    """The checkpoint a `--resume` continues from, checked before anything loads. Under a sharded layout (PLAN): the
    newest complete one, saved under the same layout (one-line KHAError otherwise: its shards and per-rank random
    states would not fit another); without one: CHECKPOINT, unless a sharded run wrote it (it holds no optimizer
    Trainer could read)."""
    if plan is None:
        if checkpoint is not None and (Path(checkpoint) / RUN_STATE_FILE).is_file():
            layout = read_json_layout(Path(checkpoint))
            raise KHAError(
                f"{Path(checkpoint).name} was saved by a run sharded at load time ({layout}): resume it with the same "
                "launch (accelerate config, processes, --tp-size / --ep-size)"
            )
        return checkpoint
    complete = last_complete_checkpoint(run_folder)
    if complete is None:
        raise KHAError(
            f"nothing to resume under this layout: {run_folder} holds no checkpoint-N that a sharded run completed "
            f"({RUN_STATE_FILE}); a run of another engine resumes with its own launch"
        )
    read_run_state(Path(complete), plan.layout())
    check_regular_files(Path(complete))
    return complete


def check_regular_files(folder: Path) -> None:
    """One-line KHAError unless everything a resume reads in FOLDER (and its optimizer/) is a regular file kept in
    it: a link would load state from elsewhere, a FIFO would block every rank."""
    import stat

    shards = folder / OPTIMIZER_DIR
    inside = shards.iterdir() if shards.is_dir() and not shards.is_symlink() else []  # its absence: load_run_state
    for entry in [*folder.iterdir(), *inside]:
        if entry.name == OPTIMIZER_DIR and entry.parent == folder and entry.is_dir() and not entry.is_symlink():
            continue
        mode = entry.lstat().st_mode
        if not stat.S_ISREG(mode):
            kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
            raise KHAError(f"{entry} is {kind}: a run resumes from checkpoints it wrote itself")


def read_json_layout(folder: Path):
    from ..common.text_files import read_json_object

    try:
        return read_json_object(folder / RUN_STATE_FILE).get("layout")
    except KHAError:
        return "unreadable"
