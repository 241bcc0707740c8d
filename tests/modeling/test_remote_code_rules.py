"""`kha_hf/modeling/` is exactly the remote-code set: every file there may travel next to a checkpoint.

transformers copies `configuration_kha.py`, `modeling_kha.py` and `knocks.py` into saved folders and later imports
them as `transformers_modules.<hash>.*`, where kha_hf does not exist: so they may import only the standard library,
torch and transformers, plus their siblings through single-dot relative imports.
"""

import ast
import sys
from pathlib import Path

import pytest
import torch

import kha_hf.modeling
from kha_hf import KHAForCausalLM
from kha_hf.common.model_code import copy_model_code
from tests.helpers import tiny_base_model

MODELING_DIR = Path(kha_hf.modeling.__file__).parent
REMOTE_CODE = {"configuration_kha.py", "modeling_kha.py", "knocks.py", "families.py", "derive.py"}
ALLOWED_TOP_LEVEL = {"torch", "transformers", "__future__"} | set(sys.stdlib_module_names)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(relative level, module name) of every import statement in the file, including those inside functions;
    `from . import x` counts as importing the sibling `x`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(0, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level and not node.module:
                found += [(node.level, alias.name) for alias in node.names]
            else:
                found.append((node.level, node.module or ""))
    return found


def test_modeling_folder_holds_exactly_the_remote_code_set():
    files = {p.name for p in MODELING_DIR.iterdir() if p.suffix == ".py"}
    assert files - {"__init__.py"} == REMOTE_CODE
    assert not [p for p in MODELING_DIR.iterdir() if p.is_dir() and p.name != "__pycache__"], "no sub-packages"


@pytest.mark.parametrize("name", sorted(REMOTE_CODE | {"__init__.py"}))
def test_every_modeling_file_imports_only_torch_transformers_and_siblings(name):
    for level, module in _imports(MODELING_DIR / name):
        if level:
            assert level == 1, f"{name}: `from {'.' * level}{module}` leaves the folder; only siblings travel"
            assert (MODELING_DIR / f"{module.split('.')[0]}.py").is_file(), f"{name}: no sibling {module}"
        else:
            top = module.split(".")[0]
            assert top in ALLOWED_TOP_LEVEL, f"{name} imports {module}: only torch/transformers/stdlib travel"


def test_the_checker_catches_a_forbidden_import(tmp_path):
    bad = tmp_path / "modeling_kha.py"
    bad.write_text("import torch\nfrom kha_hf.training import params\nfrom ..common import errors\n")
    assert (0, "kha_hf.training") in _imports(bad) and (2, "common") in _imports(bad)


def test_copied_code_is_the_modeling_folder(tmp_path):
    assert set(copy_model_code(tmp_path)) == REMOTE_CODE
    for name in REMOTE_CODE:
        assert (tmp_path / name).read_bytes() == (MODELING_DIR / name).read_bytes()
    model = KHAForCausalLM.from_base(tiny_base_model("llama"))
    model.save_pretrained(tmp_path / "saved")
    assert REMOTE_CODE <= {p.name for p in (tmp_path / "saved").iterdir()}
    assert torch.equal(model.lm_head.weight, KHAForCausalLM.from_pretrained(tmp_path / "saved").lm_head.weight)
