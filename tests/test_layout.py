"""The package layout that docs/contributing/layout.md describes: which part may import which, and no circles.

modeling/ imports no other part (it travels with checkpoints); common/ imports only modeling/; checkpoint/ (reading,
checking and writing checkpoint folders) imports common/ and modeling/; peft/ (the knock adapter), training/ and
serving/ import those and themselves, never each other (training/ also data/, the prepared corpora); conversion/
also reads knock adapters (peft/, `kha convert --adapter`), eval/ evaluates them (peft/); vllm_plugin/ imports only
modeling/ (vLLM's processes run it: nothing of kha_hf's tools there); ab/ (kha ab) sits on the tool parts,
workflows/ (kha demo) and cli/ on top of it, and nothing but the entry point imports cli/.
Within and across parts, no module imports itself back through others (`test_no_import_cycles`).
"""

import ast
import os
import sys
import sysconfig
from pathlib import Path

import pytest

import kha_hf

ROOT = Path(kha_hf.__file__).parent
ALLOWED = {
    "modeling": {"modeling"},
    "common": {"common", "modeling"},
    # checkpoint folders: read, checked once, loaded and written atomically
    "checkpoint": {"checkpoint", "common", "modeling"},
    "conversion": {"conversion", "checkpoint", "common", "modeling", "peft"},  # kha convert --adapter
    "eval": {"eval", "checkpoint", "common", "modeling", "peft"},  # kha eval --adapter: a knock adapter as candidate
    "data": {"data", "checkpoint", "common"},  # prepared corpora: kha tokenize, the token file, the global order
    "training": {"training", "checkpoint", "common", "modeling", "data"},
    "serving": {"serving", "checkpoint", "common", "modeling"},
    "peft": {"peft", "checkpoint", "common", "modeling"},  # the knock adapter, and adapters <-> KHA checkpoints
    # run in vLLM's processes (the vllm.general_plugins entry point): the model code, nothing of kha_hf's tools
    "vllm_plugin": {"vllm_plugin", "modeling"},
    # plugins for other trainers (Axolotl): the model, the knock adapter and the training rules, as a user's code would
    "integrations": {"integrations", "checkpoint", "common", "modeling", "conversion", "peft", "training"},
    # kha ab: a baseline and its twin trained alike, from scratch or continued from a checkpoint, compared over seeds
    "ab": {"ab", "checkpoint", "common", "modeling", "conversion", "data", "eval", "peft", "training"},
    # kha demo, the whole product run end to end: every tool part (an arm trained as kha ab trains it), never the CLI
    "workflows": {"workflows", "ab", "checkpoint", "common", "modeling", "conversion", "eval", "training"},
    "cli": {
        "kha_hf",
        "cli",
        "ab",
        "checkpoint",
        "common",
        "modeling",
        "conversion",
        "data",
        "eval",
        "peft",
        "serving",
        "training",
        "workflows",
    },
}


def _parts_imported(path: Path, part: str) -> set[str]:
    """The kha_hf parts a file imports (relative or absolute imports, at any depth in the file)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.level == 1:  # a sibling
                found.add(part)
            elif node.module:  # `from ..common.errors import X` or `from ..modeling import modeling_kha`
                found.add(node.module.split(".")[0])
            else:  # `from .. import register_auto_classes`: the package itself
                found.add("kha_hf")
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            for name in names:
                if name == "kha_hf" or name.startswith("kha_hf."):
                    found.add(name.split(".")[1] if "." in name else "kha_hf")
    return found


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_part_imports_only_what_the_layout_allows(part):
    files = sorted((ROOT / part).glob("*.py"))
    if not files and part == "integrations":
        pytest.skip("kha_hf/integrations/ is not in this checkout yet")
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


def _module_name(path: Path, root: Path) -> str:
    """`kha_hf/conversion/fold.py` -> `kha_hf.conversion.fold`; a package's `__init__.py` -> the package."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the kha_hf modules it imports, read statically (ast) from every file under ROOT: imports at the top
    of a file and inside functions alike (a lazy import still ties two modules together). `from pkg import name`
    points at pkg.name where that is a module, else at pkg itself."""
    paths = {_module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    top = root.name

    def resolve(target: str) -> str | None:  # the longest prefix of TARGET that is a module of ours
        parts = target.split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in paths:
                return ".".join(parts[:end])
        return None

    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: `from ..common.errors import X`, `from . import x`
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                    module = f"{base}.{node.module}" if node.module else base
                else:
                    module = node.module or ""
                targets = [f"{module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                if target == top or target.startswith(f"{top}."):
                    found = resolve(target)
                    if found is not None and found != name:
                        edges.add(found)
        graph[name] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every group of modules that import each other, directly or through others (the strongly connected components
    of more than one module, Tarjan's algorithm), each sorted; [] when the graph has no circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert not cycles, "modules that import each other (move the shared code down a layer): " + "; ".join(
        " <-> ".join(group) for group in cycles
    )


def test_the_cycle_finder_finds_a_lazy_import_cycle(tmp_path):
    """A circle closed by an import inside a function counts (how checks <-> loading and fold <-> gguf_export hid)."""
    package = tmp_path / "kha_hf"
    (package / "common").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "common" / "__init__.py").write_text("")
    (package / "common" / "a.py").write_text("from .b import f\n")
    (package / "common" / "b.py").write_text("def f():\n    from kha_hf.common import a\n")
    (package / "common" / "c.py").write_text("from . import a\n")
    assert import_cycles(import_graph(package)) == [["kha_hf.common.a", "kha_hf.common.b"]]


def test_every_part_has_a_place_in_the_layout():
    parts = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    assert parts <= set(ALLOWED), f"parts with no row in ALLOWED (say what they may import): {parts - set(ALLOWED)}"


def test_every_module_imports_only_what_its_part_allows():
    """The same rule as `test_part_imports_only_what_the_layout_allows`, over the module graph (nested folders too)."""
    for module, imported in import_graph().items():
        part = module.split(".")[1] if module.count(".") else None
        if part is None or part not in ALLOWED:
            continue
        bad = sorted(m for m in imported if m.count(".") and m.split(".")[1] not in ALLOWED[part])
        assert not bad, f"{module} imports {bad}"


def test_cli_is_imported_only_by_the_entry_point():
    """cli/ builds the parser and prints: no tool part may depend on it (`python -m kha_hf` is the entry point)."""
    for module, imported in import_graph().items():
        if module.startswith("kha_hf.cli") or module == "kha_hf.__main__":
            continue
        cli = sorted(m for m in imported if m == "kha_hf.cli" or m.startswith("kha_hf.cli."))
        assert not cli, f"{module} imports {cli}"


def test_a_checkpoint_folders_headers_are_read_in_one_place():
    """A checkpoint's safetensors headers are read through `checkpoint/reader.py`'s `open_checkpoint` (the conversion
    tools, loading, serving and training take the `Checkpoint` it returns, already checked)."""
    index_readers = set()
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("read_checkpoint_index"):
                index_readers.add(path.relative_to(ROOT).as_posix())
    assert index_readers == {"checkpoint/reader.py"}, index_readers


_CONFIG_READS: list | None = None  # (file of kha_hf that opened it, path) while a test records, else None


def _record_config_reads(event: str, args: tuple) -> None:
    """An audit hook (`sys.addaudithook`): every config.json opened for reading, by the innermost frame outside the
    standard library (pathlib's read_text and json's load are not the reader; their caller is)."""
    if _CONFIG_READS is None or event != "open" or os.path.basename(str(args[0])) != "config.json":
        return
    mode, flags = args[1], args[2]
    if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
        mode is None and flags & (os.O_WRONLY | os.O_RDWR)
    ):
        return
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(STDLIB):
        frame = frame.f_back
    if frame is not None:
        _CONFIG_READS.append((frame.f_code.co_filename, str(args[0])))


STDLIB = sysconfig.get_paths()["stdlib"]


def test_config_json_is_parsed_in_one_place(tmp_path, capsys):
    """Every config.json a command reads, found from the calls that open it (an audit hook), not from the text of
    the code: kha_hf opens it in `checkpoint/reader.py` alone (transformers' own reads, inside from_pretrained, are
    transformers' files). The commands: convert, inspect, fold, verify, adapter, train."""
    global _CONFIG_READS
    from helpers import save_tiny_checkpoint, save_tiny_tokenizer

    from kha_hf.cli import main

    base, kha = tmp_path / "base", tmp_path / "kha"
    save_tiny_checkpoint(base, "llama")
    save_tiny_tokenizer(base)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be, that is the question. " * 200)
    commands = [
        ["convert", str(base), str(kha), "--knock", "linear_qkv"],
        ["inspect", str(kha)],
        ["fold", str(kha), str(tmp_path / "folded")],
        ["verify", str(base), str(kha)],
        ["adapter", str(kha), str(tmp_path / "adapter")],
        ["train", str(kha), "--data", str(corpus), "--output", str(tmp_path / "trained"), "--max-steps", "1"],
    ]
    sys.addaudithook(_record_config_reads)  # stays installed (audit hooks cannot be removed); records only here
    _CONFIG_READS = []
    try:
        for argv in commands:
            assert main(argv) == 0, (argv, capsys.readouterr())
        reads = list(_CONFIG_READS)
    finally:
        _CONFIG_READS = None
    ours = {Path(file).relative_to(ROOT).as_posix() for file, _ in reads if Path(file).is_relative_to(ROOT)}
    assert reads, "no config.json read was seen: the audit hook records nothing"
    assert ours == {"checkpoint/reader.py"}, ours
