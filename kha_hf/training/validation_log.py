"""The run's record of its validation losses (`kha train --eval-steps N`): `validation.jsonl` in the output folder,
one line a evaluation, `{"step", "validation_loss", "tokens_seen"}`. Trainer keeps the same numbers in
`trainer_state.json`'s `log_history` (as `eval_validation_loss`); this file is the one a resumed run continues, as
`stability.jsonl` is."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from transformers import TrainerCallback

from ..common.text_files import bounded_lines, keep_rows

VALIDATION_FILE = "validation.jsonl"
METRIC = "eval_validation_loss"  # Trainer's name for the loss of eval_dataset={"validation": ...}


def read_validation_lines(path: Path) -> list[dict]:
    """The rows of PATH, each step once and in order, each loss a finite number or null; anything else (a line an
    interruption cut, an edited one, a line past 4 KiB) is skipped."""
    rows = []
    if not path.is_file() or path.is_symlink():
        return rows
    with open(path, "rb") as f:
        for line in bounded_lines(f, 4096):
            try:
                row = json.loads(line.decode("utf-8", errors="replace"))
            except ValueError:
                continue
            if not isinstance(row, dict) or type(row.get("step")) is not int or type(row.get("tokens_seen")) is not int:
                continue
            loss = row.get("validation_loss")
            finite = loss is None or (type(loss) is float and math.isfinite(loss))
            if finite and row["step"] > (rows[-1]["step"] if rows else 0):
                rows.append({key: row[key] for key in ("step", "validation_loss", "tokens_seen")})
    return rows


class ValidationRecord(TrainerCallback):
    """Appends each validation loss to PATH on the main process. The rows already there, or SOURCE's (a finished
    run resumed into a new folder), are kept up to KEEP_UNTIL (its checkpoint's step: the steps after it run again),
    so each evaluation is there once, in order."""

    def __init__(self, path: Path, keep_until: int | None = None, main: bool = True, source: Path | None = None):
        self.path, self.main = path, main
        if main:
            keep_rows(path, read_validation_lines, keep_until, source)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        loss = (metrics or {}).get(METRIC)
        if self.main and isinstance(loss, float):
            row = {"step": state.global_step, "validation_loss": loss if math.isfinite(loss) else None}
            row["tokens_seen"] = int(state.num_input_tokens_seen or 0)
            # O_NOFOLLOW: a link put in place of the record is refused, never written through (#70)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
        return control
