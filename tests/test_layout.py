"""The package layout that README's "Layout" section describes: which part may import which.

modeling/ imports no other part (it travels with checkpoints); common/ imports only modeling/; conversion/, eval/,
training/, serving/ and peft/ import modeling/, common/ and themselves, never each other; vllm_plugin/ imports
only modeling/ (vLLM's processes run it: nothing of kha_hf's tools there); workflows/ and cli/ sit on top.
"""

import ast
from pathlib import Path

import pytest

import kha_hf

ROOT = Path(kha_hf.__file__).parent
ALLOWED = {
    "modeling": {"modeling"},
    "common": {"common", "modeling"},
    "conversion": {"conversion", "common", "modeling"},
    "eval": {"eval", "common", "modeling", "peft"},  # a knock adapter as the candidate (kha eval --adapter)
    "training": {"training", "common", "modeling"},
    "serving": {"serving", "common", "modeling"},
    "peft": {"peft", "common", "modeling", "conversion"},  # adapters <-> KHA checkpoints (adapter_files.py)
    # run in vLLM's processes (the vllm.general_plugins entry point): the model code, nothing of kha_hf's tools
    "vllm_plugin": {"vllm_plugin", "modeling"},
}


def _parts_imported(path: Path, part: str) -> set[str]:
    """The kha_hf parts a file imports (relative or absolute imports, at any depth in the file)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.level == 1:  # a sibling
                found.add(part)
            else:  # `from ..common.errors import X` or `from ..modeling import modeling_kha`
                found.add((node.module or node.names[0].name).split(".")[0])
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            for name in names:
                if name == "kha_hf" or name.startswith("kha_hf."):
                    found.add(name.split(".")[1] if "." in name else "kha_hf")
    return found


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_part_imports_only_what_the_layout_allows(part):
    files = sorted((ROOT / part).glob("*.py"))
    assert files, f"kha_hf/{part}/ is missing"
    for path in files:
        bad = _parts_imported(path, part) - ALLOWED[part]
        assert not bad, f"kha_hf/{part}/{path.name} imports {sorted(bad)}"


def test_cli_has_one_module_per_subcommand():
    from kha_hf.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    modules = {p.stem for p in (ROOT / "cli").glob("*.py") if not p.stem.startswith("_")}
    assert modules == set(commands)


def test_vllm_eval_worker_imports_nothing_of_kha_hf():
    """kha_hf/eval/vllm_worker.py runs by path in vLLM's environment, which need not hold kha_hf (its plugin only
    serves KHA checkpoints; a vLLM environment without kha-hf still scores plain ones)."""
    path = ROOT / "eval" / "vllm_worker.py"
    assert not _parts_imported(path, "eval"), "vllm_worker.py imports kha_hf: a vLLM environment may not have it"
