"""The folder a training run works in: one temporary sibling of OUTPUT shared by every process of the run.

`checkpoint.output.atomic_output_dir` gives the safety (OUTPUT appears only when the model is saved, an earlier OUTPUT
stays intact until then, an interrupted run with checkpoints is kept for --resume). Under `accelerate launch` every
rank writes into the same checkpoint folders (FSDP shards, trainer state), so the main process creates the folder,
tells the others its name, and puts it in place only after every rank has finished writing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from pathlib import Path

from ..checkpoint.output import atomic_output_dir
from ..checkpoint.paths import is_training_run


@contextlib.contextmanager
def run_output_dir(dst: Path, overwrite: bool, args, adopt: Path | None = None) -> Iterator[Path]:
    """Yield the working folder of a training run whose result becomes DST; ARGS (TrainingArguments) are pointed
    at it. The process group is the one ARGS set up (accelerate's state), never one of our own."""
    output = partial(
        atomic_output_dir, dst, overwrite=overwrite, keep_on_failure=is_training_run, adopt=adopt, marker="train"
    )
    if args.world_size <= 1:  # reading world_size sets up the device and, under a launcher, the process group
        with output() as work:
            args.output_dir = str(work)
            yield work
        return
    import torch.distributed as dist
    from accelerate import PartialState

    state = PartialState()  # the state TrainingArguments initialised (a shared singleton)
    if state.is_main_process:
        with output() as work:
            dist.broadcast_object_list([str(work)], src=0)
            args.output_dir = str(work)
            yield work
            state.wait_for_everyone()  # every rank has written its part before the folder is put in place
    else:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        args.output_dir = box[0]
        yield Path(box[0])
        state.wait_for_everyone()
