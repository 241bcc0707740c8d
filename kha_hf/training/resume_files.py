"""What a `--resume` reads from a run's folder, checked before any rank loads it (one-line KHAError otherwise).

- Every entry of the run's folder is a folder or a regular file kept in it: a link would read state from elsewhere
  (or, for the stability record, append the run's rows to wherever it points), a FIFO would block every rank.
- The checkpoint is the newest complete one: a kill during a save leaves `checkpoint-N` without the trainer state
  Trainer writes last, and the run continues from the one before.
- It holds what an exact resume needs: the weights, and the optimizer and scheduler states (without them Trainer
  starts a fresh optimizer and says nothing). Runs sharded at load time keep theirs in kha's run state (run_state.py).
- Trainer loads its own pickled states with `torch.load(weights_only=True)`; DeepSpeed loads its model and optimizer
  states with `weights_only=False` (deepspeed 0.19, `TorchCheckpointEngine.load`), which runs whatever code a pickle
  names. Those files are read statically first (torch's `get_unsafe_globals_in_checkpoint`: every global the pickle
  would import, without loading it) and must name only what a weights-only load allows plus DeepSpeed's own plain
  data classes; a pickle it cannot read that way is refused too. `--trust-checkpoint-pickle` loads such a checkpoint
  anyway, for one its user wrote.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from pathlib import Path

from ..common.errors import KHAError

TRAINER_STATE = "trainer_state.json"  # the last file of a Trainer checkpoint
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors")
DEEPSPEED_TAG = "latest"  # DeepSpeed's pointer to the folder of its states (global_stepN)
# The classes DeepSpeed's states pickle beside tensors (deepspeed 0.19, ZeRO-2 and ZeRO-3): plain data, whose
# construction runs no code of the file's choosing
DEEPSPEED_DATA = frozenset(
    {
        "deepspeed.utils.tensor_fragment.fragment_address",
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
    }
)
TRUST = "--trust-checkpoint-pickle loads it anyway, for a checkpoint you wrote yourself"


def check_run_entries(run_folder: Path) -> None:
    """Every entry under RUN_FOLDER is a folder or a regular file, none a link (the folder itself included)."""
    run_folder = Path(run_folder)
    for root, folders, files in os.walk(run_folder):  # os.walk never follows a link to a folder
        for name in [*folders, *files]:
            _check_entry(Path(root) / name)


def _check_entry(path: Path) -> None:
    mode = path.lstat().st_mode
    if stat.S_ISLNK(mode):
        raise KHAError(f"{path} is a symbolic link: a resumed run reads and writes only the files it wrote itself")
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        raise KHAError(f"{path} is not a regular file (a FIFO, socket or device): not part of a run to resume")


def last_complete_checkpoint(run_folder: Path, mark: str = TRAINER_STATE) -> str | None:
    """The newest `checkpoint-N` of RUN_FOLDER that holds MARK, the last file its save writes (Trainer's state; a
    sharded run's `kha_run_state.json`), saying so when a newer one lacks it: a kill during a save leaves the newest
    one without it, and the run continues from the one before. Links are never taken (`check_run_entries` refuses
    them first)."""
    steps = []
    for folder in Path(run_folder).glob("checkpoint-*"):
        step = folder.name.removeprefix("checkpoint-")
        if step.isascii() and step.isdigit() and folder.is_dir() and not folder.is_symlink():
            steps.append((int(step), folder))
    complete = [(n, f) for n, f in steps if (f / mark).is_file() and not (f / mark).is_symlink()]
    if not complete:
        return None
    newest = max(complete)[1]
    if max(steps)[1] != newest:
        print(f"{max(steps)[1].name} is incomplete (no {mark}: its save was interrupted); resuming from {newest.name}")
    return str(newest)


def check_checkpoint_files(checkpoint: str | Path, trust_pickle: bool = False) -> None:
    """CHECKPOINT (a Trainer checkpoint, plain or DeepSpeed's) holds weights, optimizer and scheduler states, and
    nothing DeepSpeed would unpickle names code beyond plain data (unless TRUST_PICKLE)."""
    folder = Path(checkpoint)
    tag = _deepspeed_states(folder)
    if tag is None and not any((folder / name).is_file() for name in WEIGHTS):
        raise KHAError(f"{folder} holds no model weights ({WEIGHTS[0]}): not a checkpoint to resume from")
    optimizer = "optimizer.pt" if tag is None else f"{tag.name}/*optim_states.pt"
    found = (folder / "optimizer.pt").is_file() if tag is None else any(tag.glob("*optim_states.pt"))
    for name, present in ((optimizer, found), ("scheduler.pt", (folder / "scheduler.pt").is_file())):
        if not present:
            raise KHAError(
                f"{folder} has no {name}: resuming would start a fresh optimizer and schedule, not continue the run"
            )
    if tag is not None and not trust_pickle:
        for path in sorted(tag.glob("*.pt")):
            _check_pickle(path)


def _deepspeed_states(folder: Path) -> Path | None:
    """The folder of DeepSpeed's states that FOLDER's `latest` names (None: not a DeepSpeed checkpoint). The name
    must be a folder inside FOLDER: DeepSpeed joins it to the path and loads what it finds there."""
    pointer = folder / DEEPSPEED_TAG
    if not pointer.exists():
        return None
    with open(pointer, "rb") as f:  # a tag is a short folder name: what lies past 4 KiB is no tag
        name = f.read(4096).decode("utf-8", errors="replace").strip()
    if not name or name in (".", "..") or "/" in name or "\\" in name or not (folder / name).is_dir():
        raise KHAError(f"{pointer} names {name[:80]!r}, not a folder of DeepSpeed's states inside {folder.name}")
    states = folder / name
    if not any(states.glob("*model_states.pt")):
        raise KHAError(f"{states} holds no DeepSpeed model states (*model_states.pt): not a checkpoint to resume from")
    return states


def _check_pickle(path: Path) -> None:
    from torch.serialization import get_unsafe_globals_in_checkpoint

    try:
        named = set(get_unsafe_globals_in_checkpoint(str(path)))
    except Exception as err:  # not torch.save's zip format, or opcodes a weights-only load would not run
        raise KHAError(
            f"cannot resume from {path.parent.parent.name}: {path.name} is no pickle that can be read without running "
            f"it ({type(err).__name__}); {TRUST}"
        ) from None
    code = sorted(named - DEEPSPEED_DATA)
    if code:
        raise KHAError(
            f"cannot resume from {path.parent.parent.name}: DeepSpeed would unpickle {path.name}, which names "
            f"{', '.join(code[:3])} (code that loading runs); {TRUST}"
        )


def check_random_states(checkpoint: str | Path) -> None:
    """Every `rng_state*.pth` of CHECKPOINT loads as Trainer loads its own rank's (weights-only, with transformers'
    `safe_globals`), or a one-line KHAError: each rank reads only its own file, so a planted pickle in rank 1's was
    refused on rank 1 alone while rank 0 died of the broken connection, and no line said why."""
    import pickle

    import torch
    from transformers.trainer_pt_utils import safe_globals

    for path in sorted(Path(checkpoint).glob("rng_state*.pth")):
        try:
            with safe_globals():
                torch.load(path, weights_only=True, map_location="cpu")
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as err:
            from .guards import unpickling_reason

            found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
            reason = f"it names {found.group(1)}; nothing of it ran" if found else unpickling_reason(err)
            raise KHAError(
                f"cannot resume from {Path(checkpoint).name}: {path.name} is no random state ({reason})"
            ) from None


@contextlib.contextmanager
def resume_lock(folder: Path | None):
    """An exclusive lock on FOLDER (a finished run being resumed) while this run works: a second `--resume` of the
    same output is refused in one line instead of both training and the last to finish replacing the other's
    result. None: nothing to lock (another rank, or a run that is no resume of a finished one)."""
    if folder is None:
        yield
        return
    from ..checkpoint.output import hold_lock

    fd = hold_lock(folder, f"{folder} is being resumed by another run")
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)
