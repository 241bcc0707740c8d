"""The run cache of `kha ab`: each finished run kept as JSON (runs/ARM-seedN.json) beside the settings it ran with
(ab_settings.json), in the output's temporary folder, so an interrupted A/B started again with the same settings
trains only what is missing. A kept file is read back only if it is exactly what `keep` wrote."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import asdict
from pathlib import Path

from ..checkpoint.output import check_adoptable, resumable_partials
from ..common.errors import KHAError
from .ab_report import ArmRun, write_json
from .stability import is_stability_row

RUNS_DIR = "runs"  # finished runs, one JSON each, inside the output's temporary folder (the run cache)
SETTINGS_FILE = "ab_settings.json"
MAX_RUN_FILE = 256 << 20  # a kept run: its curve and per-step records (5000 steps: about 1 MB)


def data_fingerprint(data: list[str] | None, train_blocks: int, heldout_blocks: int) -> str:
    """What identifies the training text for the run cache: the paths given, each file's size and mtime, and the
    block counts (the embedded Shakespeare when DATA is None)."""
    parts = [train_blocks, heldout_blocks]
    for name in data or []:
        path = Path(name)
        files = sorted(path.rglob("*")) if path.is_dir() else [path]
        parts += [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def interrupted_run(final: Path, settings: dict) -> Path | None:
    """The temporary folder an interrupted A/B of FINAL left with finished runs, if its settings are these; a
    folder of other settings is refused (its runs would not be paired with new ones)."""
    kept = resumable_partials(final)
    if not kept:
        return None
    folder = check_adoptable(kept[0], final)
    if any((folder / name).is_symlink() for name in (SETTINGS_FILE, RUNS_DIR)):
        raise KHAError(f"{folder} holds a symbolic link where kha ab keeps its runs; remove that folder")
    try:
        recorded = json.loads((folder / SETTINGS_FILE).read_text())
    except (OSError, ValueError):
        recorded = None
    if recorded != json.loads(json.dumps(settings, sort_keys=True, default=str)):
        raise KHAError(
            f"{folder} holds finished runs of an interrupted A/B of {final} with other settings; start it again "
            "with the same settings to reuse them, or remove that folder"
        )
    for path in (folder / RUNS_DIR).iterdir():  # every kept run read now: a bad one is refused before anything runs
        arm, _, seed = path.name.removesuffix(".json").rpartition("-seed")
        if path.suffix == ".json" and seed.isdigit():
            cached(folder, arm, int(seed))
    print(f"run cache: reusing the {len(list((folder / RUNS_DIR).glob('*.json')))} finished runs in {folder}")
    return folder


def cached(output: Path, arm: str, seed: int) -> ArmRun | None:
    """The finished run ARM, SEED kept in OUTPUT's run cache, or None; a file that is not what `_keep` wrote (edited,
    cut, planted) is refused in one line rather than paired with fresh runs."""
    path = output / RUNS_DIR / f"{arm}-seed{seed}.json"
    if path.is_symlink() or not path.exists():
        return None
    fields = {f.name for f in dataclasses.fields(ArmRun)} - {"model"}
    try:
        if not path.is_file() or path.stat().st_size > MAX_RUN_FILE:
            raise ValueError("not a regular file of a run's size")
        data = json.loads(path.read_bytes().decode("utf-8"))
        if not isinstance(data, dict) or set(data) != fields or (data["arm"], data["seed"]) != (arm, seed):
            raise ValueError("not the fields of this run")
        curve, losses = data["curve"], [data["train_loss"], data["heldout_loss"]]
        if not isinstance(curve, list) or not curve or not all(isinstance(p, list) and len(p) == 2 for p in curve):
            raise ValueError("its loss curve is not a list of (step, loss)")
        if not all(isinstance(step, int) and _is_loss(loss) for step, loss in curve) or not all(map(_is_loss, losses)):
            raise ValueError("its losses are not numbers")
        stability = data["stability"]
        if not isinstance(stability, list) or not all(is_stability_row(row) for row in stability):
            raise ValueError("its per-step records are not rows of kha ab's")
        # a diverged run was kept with null for NaN (strict JSON): read back as NaN
        data["curve"] = [(step, math.nan if loss is None else float(loss)) for step, loss in curve]
        for key in ("train_loss", "heldout_loss"):
            data[key] = math.nan if data[key] is None else float(data[key])
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise KHAError(f"{path} is not a run kha ab kept ({err}); remove the folder {output} to start afresh") from err
    return ArmRun(**data)


def _is_loss(value) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def keep(output: Path, run: ArmRun) -> None:
    folder = output / RUNS_DIR
    folder.mkdir(exist_ok=True)
    fields = {k: v for k, v in asdict(run).items() if k != "model"}
    tmp = folder / f".{run.arm}-seed{run.seed}.json.tmp"
    write_json(tmp, fields)
    tmp.replace(folder / f"{run.arm}-seed{run.seed}.json")  # whole or absent: a cut run is trained again
