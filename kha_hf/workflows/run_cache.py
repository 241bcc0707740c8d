"""`kha ab --from MODEL --run-cache DIR`: each finished run's numbers kept in DIR, so that an A/B that was stopped
(a session's end, a killed job) and is started again with the same DIR and settings continues where it stopped.

A Gemma 3 270M A/B of the four adapter arms is about 23 runs of 4 min on a 2-core CPU; without this, a stop at run
20 loses all of them. A run is reused only when everything that decides its numbers is the same (its key):
- the arm's starting point, pinned by its losses on every held-out and other-domain block before training (the
  weights themselves, whatever file, path or Hub revision they came from), and the exact token blocks of every split;
- the knock, steps, sequence length, batch size, the LoRA control's rank and targets (for that arm), the arm, seed
  and rate;
- the code that trains and measures (a hash of kha_hf's modeling, peft, training, conversion and common packages and
  of continued_ab.py), the versions of torch, transformers and peft, and whether CUDA is used.
A file that is not a regular file of at most MAX_BYTES, does not parse, or does not hold a run of that key with
numbers of the right types and sizes is ignored (said in one line) and the run is trained again. DIR holds JSON
only, nothing in it is executed, and a file is written whole (a new temporary file renamed over the final name).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import tempfile
from importlib.metadata import version
from pathlib import Path

import torch

from ..common.errors import KHAError
from ..training.ab_report import ArmRun

MAX_BYTES = 1 << 20  # a run's file: a few KB (block losses and a curve of at most a few hundred points)
CODE = ("modeling", "peft", "training", "conversion", "common", "workflows/continued_ab.py")  # what decides numbers
PACKAGE = Path(__file__).resolve().parents[1]


def code_digest() -> str:
    """sha256 of the source of the parts of kha_hf that train and measure a run (CODE), in path order."""
    digest = hashlib.sha256()
    for part in CODE:
        path = PACKAGE / part
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.is_file() else []:
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


def _number(value, name: str) -> float:
    """VALUE as a float: a JSON number (NaN and infinities allowed: a diverged run's losses), not a bool."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} is not a number")
    return float(value)  # OverflowError for an integer beyond float's range


def _count(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"{name} is not a count")
    return value


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
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return None
        except OSError as err:
            print(f"run cache: ignoring {path} ({err.strerror}); training this run again")
            return None
        try:
            if not stat.S_ISREG(info.st_mode):
                raise ValueError("not a regular file")
            if info.st_size > MAX_BYTES:
                raise ValueError(f"{info.st_size} bytes, more than a run's file holds")
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            with os.fdopen(fd, "rb") as f:
                data = json.loads(f.read(MAX_BYTES + 1))
            run = self._run(data, arm, seed, lr, n_blocks)
        except Exception as err:  # noqa: BLE001 - whatever the file holds, it is ignored, never trusted
            print(f"run cache: ignoring {path} ({type(err).__name__}: {err}); training this run again")
            return None
        self.reused += 1
        return run

    def put(self, run: ArmRun) -> None:
        """RUN's numbers, written whole: a new temporary file (exclusive create) renamed over the final name. A
        failed write is said in one line; the A/B goes on without it."""
        data = {
            "key": self.keys[run.arm],
            "arm": run.arm,
            "seed": run.seed,
            "lr": run.lr,
            "curve": [list(point) for point in run.curve],
            **{name: getattr(run, name) for name in ("train_loss", "heldout_loss", "validation_loss")},
            **{name: getattr(run, name) for name in ("heldout_blocks", "other_blocks", "trainable_parameters")},
            "wall_seconds": run.wall_seconds,
            "flops": run.flops,
        }
        path = self.path(run.arm, run.seed, run.lr)
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{path.name}.", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, path)
        except OSError as err:
            print(f"run cache: could not keep {path.name} ({err.strerror or err}); the A/B goes on")
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)

    def _run(self, data, arm: str, seed: int, lr: float, n_blocks: tuple[int, int]) -> ArmRun:
        if not isinstance(data, dict) or data.get("key") != self.keys[arm]:
            raise ValueError("not a run of these settings")
        if data.get("arm") != arm or _count(data.get("seed"), "seed") != seed:
            raise ValueError("another arm or seed than its name says")
        if not math.isclose(_number(data.get("lr"), "lr"), lr, rel_tol=1e-9):
            raise ValueError("another rate than its name says")
        blocks = []
        for name, n in zip(("heldout_blocks", "other_blocks"), n_blocks, strict=True):
            values = data.get(name)
            if not isinstance(values, list) or len(values) != n:
                raise ValueError(f"{name}: not {n} block losses")
            blocks.append([_number(v, name) for v in values])
        curve = data.get("curve")
        if not isinstance(curve, list) or len(curve) > self.steps:
            raise ValueError(f"curve: not a list of at most {self.steps} points")
        points = []
        for point in curve:
            if not isinstance(point, list) or len(point) != 2:
                raise ValueError("curve: not [step, loss] points")
            step = _count(point[0], "curve step")
            if not 0 < step <= self.steps:
                raise ValueError(f"curve: step {step} outside 1..{self.steps}")
            points.append((step, _number(point[1], "curve loss")))
        flops = data.get("flops")
        return ArmRun(
            arm=arm,
            seed=seed,
            lr=lr,
            curve=points,
            train_loss=_number(data.get("train_loss"), "train_loss"),
            heldout_loss=_number(data.get("heldout_loss"), "heldout_loss"),
            validation_loss=_number(data.get("validation_loss"), "validation_loss"),
            heldout_blocks=blocks[0],
            other_blocks=blocks[1],
            trainable_parameters=_count(data.get("trainable_parameters"), "trainable_parameters"),
            wall_seconds=_number(data.get("wall_seconds"), "wall_seconds"),
            flops=None if flops is None else _number(flops, "flops"),
        )
