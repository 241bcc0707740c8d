"""The remote-code files that travel with every KHA checkpoint (the `kha_hf/modeling` set)."""

from __future__ import annotations

import shutil
from pathlib import Path


def model_code_files() -> list[Path]:
    """The installed modeling_kha.py and the siblings it imports, as `save_pretrained` finds them."""
    from transformers.dynamic_module_utils import get_relative_import_files

    from ..modeling import modeling_kha

    return [Path(modeling_kha.__file__), *map(Path, get_relative_import_files(modeling_kha.__file__))]


def copy_model_code(dst: Path) -> list[str]:
    """Copy the self-contained KHA code files that `save_pretrained` would copy (remote code)."""
    files = model_code_files()
    for path in files:
        shutil.copyfile(path, dst / path.name)
    return sorted(p.name for p in files)
