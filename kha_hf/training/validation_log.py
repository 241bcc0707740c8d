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

VALIDATION_FILE = "validation.jsonl"
METRIC = "eval_validation_loss"  # Trainer's name for the loss of eval_dataset={"validation": ...}


def read_validation_lines(path: Path) -> list[dict]:
    """The rows of PATH (a line an interruption cut, or one that is not a row, is skipped)."""
    rows = []
    if not path.is_file():
        return rows
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and type(row.get("step")) is int and isinstance(row.get("validation_loss"), float):
                rows.append(row)
    return rows


class ValidationRecord(TrainerCallback):
    """Appends each validation loss to PATH on the main process. A resumed run's rows past KEEP_UNTIL (its
    checkpoint's step: those steps run again) are dropped first, so each evaluation is there once, in order."""

    def __init__(self, path: Path, keep_until: int | None = None, main: bool = True) -> None:
        self.path, self.main = path, main
        if main and path.is_file() and not path.is_symlink():
            kept = [r for r in read_validation_lines(path) if keep_until is None or r["step"] <= keep_until]
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))  # at most one row an evaluation: small
            os.replace(tmp, path)

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
