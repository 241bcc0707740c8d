"""The run caches of `kha ab`: each finished run (`ArmRun`) kept as one JSON file, written whole (a new temporary file,
created exclusively, renamed over its name) and read back only as a run of its arm and seed with numbers of the
right types (`read_run`); a file of at most a set size, never through a link, nothing in it executed.

From scratch, the output's temporary folder keeps its runs (runs/ARM-seedN.json) beside the settings they ran with
(ab_settings.json), so an interrupted A/B started again with the same settings trains only what is missing
(`interrupted_run`, `cached`, `keep`). A kept file that is not what `keep` wrote is refused in one line.

With --from, `--run-cache DIR` keeps each run's numbers (`RunCache`), so an A/B that was stopped (a session's end, a
killed job) and is started again with the same DIR and settings continues where it stopped. A Gemma 3 270M A/B of
the four adapter arms is about 23 runs of 4 min on a 2-core CPU; without this, a stop at run 20 loses all of them. A
run is reused only when everything that decides its numbers is the same (its key):
- the arm's starting point, pinned by its losses on every held-out and other-domain block before training (the
  weights themselves, whatever file, path or Hub revision they came from), and the exact token blocks of every split;
- the knock, steps, sequence length, batch size, the LoRA control's rank and targets (for that arm), the arm, seed
  and rate;
- the code that trains and measures (a hash of kha_hf's modeling, peft, training, conversion, common and ab
  packages), the versions of torch, transformers and peft, and whether CUDA is used.
A file that is not a run of that key, rate and block counts is ignored (said in one line) and the run trained again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import stat
import tempfile
from importlib.metadata import version
from pathlib import Path

import torch

from ..checkpoint.output import check_adoptable, resumable_partials
from ..common.errors import KHAError
from ..training.stability import is_stability_row
from .arm import ArmRun
from .report import strict_json

RUNS_DIR = "runs"  # finished runs, one JSON each, inside the output's temporary folder (the run cache)
SETTINGS_FILE = "ab_settings.json"
MAX_RUN_FILE = 256 << 20  # a kept run: its curve and per-step records (5000 steps: about 1 MB)
MAX_BYTES = 1 << 20  # a --run-cache file: a few KB (block losses and a curve of at most a few hundred points)
CODE = ("modeling", "peft", "training", "conversion", "common", "ab")  # the subpackages that decide a run's numbers
PACKAGE = Path(__file__).resolve().parents[1]
FIELDS = {f.name for f in dataclasses.fields(ArmRun)} - {"model"}
NUMBERS = ("train_loss", "heldout_loss", "heldout_before", "lr", "validation_loss", "wall_seconds", "flops")
SCRATCH_REQUIRED = ("train_loss", "heldout_loss")  # the numbers every kept run has (null: NaN)
CONTINUED_REQUIRED = (*SCRATCH_REQUIRED, "validation_loss", "lr", "wall_seconds", "trainable_parameters")
CONTINUED_REQUIRED += ("heldout_blocks", "other_blocks")


def write_run(path: Path, run: ArmRun, **extra) -> None:
    """RUN's fields (and EXTRA) as strict JSON in PATH, whole or not at all."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(strict_json({**extra, **{name: getattr(run, name) for name in sorted(FIELDS)}}))
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def read_run(path: Path, max_bytes: int, arm: str, seed: int, steps: int | None = None, required=(), **extra):
    """The run of ARM at SEED that `write_run` kept in PATH (a regular file of at most MAX_BYTES): its curve within
    STEPS, every field of REQUIRED given, EXTRA's fields as given. A null number is a NaN (strict JSON) where a
    number is required. ValueError or TypeError in one line for anything else."""
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        raise ValueError("not a regular file")
    if info.st_size > max_bytes:
        raise ValueError(f"{info.st_size} bytes, more than a run's file holds")
    with os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), "rb") as f:
        data = json.loads(f.read(max_bytes + 1))
    if not isinstance(data, dict) or set(data) != FIELDS | set(extra):
        raise ValueError("not the fields of a run")
    if any(data[name] != value for name, value in extra.items()):
        raise ValueError("not a run of these settings")
    if data["arm"] != arm or type(data["seed"]) is not int or data["seed"] != seed:
        raise ValueError("another arm or seed than its name says")
    curve, last = data["curve"], steps or math.inf
    points = isinstance(curve, list) and all(isinstance(p, list) and len(p) == 2 for p in curve)
    if not points or not 0 < len(curve) <= last or not all(type(s) is int and 0 < s <= last for s, _ in curve):
        raise ValueError("its loss curve is not (step, loss) points" + (f" of steps 1 to {steps}" if steps else ""))
    fields = {name: data[name] for name in FIELDS} | {"curve": [(s, _number(x, "a loss", True)) for s, x in curve]}
    fields |= {name: _number(data[name], name, name in required) for name in NUMBERS}
    for name in ("heldout_blocks", "other_blocks"):
        if data[name] is not None or name in required:
            if not isinstance(data[name], list):
                raise ValueError(f"{name}: not a list of block losses")
            fields[name] = [_number(x, name, True) for x in data[name]]
    fields["validation_curve"] = _validation_curve(data["validation_curve"])
    count = data["trainable_parameters"]
    if (count is not None or "trainable_parameters" in required) and (type(count) is not int or count < 0):
        raise TypeError("trainable_parameters is not a count")
    stability = data["stability"]
    if stability is not None and (not isinstance(stability, list) or not all(map(is_stability_row, stability))):
        raise ValueError("its per-step records are not rows of kha ab's")
    return ArmRun(**fields)


def _validation_curve(points) -> list[tuple[int, float]] | None:
    """A kept run's (step, validation loss) points, or None where it evaluated nothing while training."""
    if points is None:
        return None
    if not isinstance(points, list) or not all(
        isinstance(p, list) and len(p) == 2 and type(p[0]) is int for p in points
    ):
        raise ValueError("its validation curve is not (step, loss) points")
    return [(step, _number(loss, "a validation loss", True)) for step, loss in points]


def _number(value, name: str, required: bool) -> float | None:
    """VALUE as a float (NaN and infinities allowed: a diverged run's losses); null is NaN where REQUIRED."""
    if value is None:
        return math.nan if required else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} is not a number")
    return float(value)  # OverflowError for an integer beyond float's range


# From scratch: the runs kept in the output's temporary folder


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
    """The finished run ARM, SEED kept in OUTPUT's run cache, or None; a file that is not what `keep` wrote (edited,
    cut, planted) is refused in one line rather than paired with fresh runs."""
    path = output / RUNS_DIR / f"{arm}-seed{seed}.json"
    if path.is_symlink() or not path.exists():
        return None
    try:
        return read_run(path, MAX_RUN_FILE, arm, seed, required=SCRATCH_REQUIRED)
    except (OSError, ValueError, TypeError, OverflowError) as err:
        raise KHAError(f"{path} is not a run kha ab kept ({err}); remove the folder {output} to start afresh") from err


def keep(output: Path, run: ArmRun) -> None:
    (output / RUNS_DIR).mkdir(exist_ok=True)
    write_run(output / RUNS_DIR / f"{run.arm}-seed{run.seed}.json", run)  # whole or absent: a cut run trains again


# With --from: --run-cache DIR


def code_digest() -> str:
    """sha256 of the source of the parts of kha_hf that train and measure a run (CODE), in path order."""
    digest = hashlib.sha256()
    for part in CODE:  # each a subpackage (a folder)
        for file in sorted((PACKAGE / part).rglob("*.py")):
            digest.update(str(file.relative_to(PACKAGE)).encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()


def blocks_digest(*splits) -> str:
    """sha256 of the token ids of every split (TokenBlocks), in order."""
    digest = hashlib.sha256()
    for split in splits:
        digest.update(str(tuple(split.blocks.shape)).encode())
        digest.update(split.blocks.contiguous().numpy().tobytes())
    return digest.hexdigest()


def check_cache_dir(folder: str | Path, output: Path, model: str) -> Path:
    """FOLDER made if needed and writable; refused where it would write into the A/B's output or the source
    model's folder (a GGUF file's folder too)."""
    if not str(folder).strip():
        raise KHAError("--run-cache needs a folder")
    folder = Path(folder).expanduser().resolve()
    source = Path(model).expanduser()
    protected = [(output, "the A/B's --output")]
    if source.is_dir():
        protected.append((source, "the model's folder"))
    elif source.is_file():
        protected.append((source.resolve().parent, "the model file's folder"))
    for other, what in protected:
        other = other.resolve()
        if folder == other or other in folder.parents:
            raise KHAError(f"--run-cache {folder} is inside {what} ({other}): give a folder of its own")
    if folder.exists() and not folder.is_dir():
        raise KHAError(f"--run-cache {folder} exists and is not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".kha-probe-"):
            pass
    except OSError as err:
        raise KHAError(f"--run-cache {folder} cannot be written: {err.strerror or err}") from None
    return folder


class RunCache:
    """Finished runs of one A/B in FOLDER, a JSON file per run. COMMON: what every run's numbers depend on
    (JSON-able); PER_ARM: arm -> what only that arm's depend on (its losses before training, the LoRA's rank)."""

    def __init__(self, folder: Path, common: dict, per_arm: dict[str, dict], steps: int) -> None:
        self.folder = folder
        self.steps = steps
        packages = {name: version(name) for name in ("torch", "transformers", "peft")}
        shared = {**common, "code": code_digest(), "versions": packages, "cuda": torch.cuda.is_available()}
        self.keys = {
            arm: hashlib.sha256(json.dumps({**shared, "arm": arm, **extra}, sort_keys=True).encode()).hexdigest()[:16]
            for arm, extra in per_arm.items()
        }
        self.reused = 0

    def path(self, arm: str, seed: int, lr: float) -> Path:
        return self.folder / f"{self.keys[arm]}-{arm}-seed{seed}-lr{lr:.6g}.json"

    def get(self, arm: str, seed: int, lr: float, n_blocks: tuple[int, int]) -> ArmRun | None:
        """The stored run of ARM at SEED and LR, or None; N_BLOCKS: (held-out, other-domain) blocks it must hold."""
        path = self.path(arm, seed, lr)
        if not os.path.lexists(path):
            return None
        try:
            run = read_run(path, MAX_BYTES, arm, seed, self.steps, CONTINUED_REQUIRED, key=self.keys[arm])
            if not math.isclose(run.lr, lr, rel_tol=1e-9):
                raise ValueError("another rate than its name says")
            if (len(run.heldout_blocks), len(run.other_blocks)) != n_blocks:
                raise ValueError(f"not {n_blocks} (held-out, other-domain) block losses")
        except Exception as err:  # noqa: BLE001 - whatever the file holds, it is ignored, never trusted
            print(f"run cache: ignoring {path} ({type(err).__name__}: {err}); training this run again")
            return None
        self.reused += 1
        return run

    def put(self, run: ArmRun) -> None:
        """RUN's numbers, written whole; a failed write is said in one line and the A/B goes on without it."""
        path = self.path(run.arm, run.seed, run.lr)
        try:
            write_run(path, run, key=self.keys[run.arm])
        except OSError as err:
            print(f"run cache: could not keep {path.name} ({err.strerror or err}); the A/B goes on")
