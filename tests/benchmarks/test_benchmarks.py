"""The benchmark scripts keep working: each runs its --quick mode (no timing is asserted, only that it reports)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize(
    "script, extra_args, expected",
    [
        ("train_step.py", [], ["ratio vs baseline", "mlp_v_linear_qk", "mlp_qkv", "gate_v", "saved for backward"]),
        ("stability_cost.py", [], ["probe installed, idle", "probing (the K-th step)", "probe every 50 steps"]),
        ("decode.py", [], ["linear_qkv folded", "aten ops / step"]),
        # two torch.compile runs (about a minute on 2 CPU cores): the exhaustive tier (tests/conftest.py)
        pytest.param(
            "decode.py",
            ["--compile"],
            ["linear_qkv folded", "aten ops / step", "torch.compile + static cache"],
            marks=pytest.mark.exhaustive,
        ),
        ("convert_memory.py", [], ["kha convert (copy)", "naive load-modify-save", "kha fold"]),
        ("cli_startup.py", [], ["ratio vs transformers --help", "kha train --help", "argument error"]),
        ("corpus_scale.py", [], ["in memory (`pack`, 1 core)", "peak RSS, large / small", "loader / training"]),
        ("adopt_scale.py", [], ["| 64 MiB | hard link |", "peak RSS, large / small (--copy)"]),
    ],
)
def test_benchmark_quick_mode_reports(script, extra_args, expected):
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick", *extra_args], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for text in expected:
        assert text in out.stdout, out.stdout


def test_vllm_throughput_table_pairs_rounds():
    """benchmarks/vllm_throughput.py's paired table: each model's ratio is the geometric mean over rounds of its rate
    over the base's in the same round (not a ratio of medians), with a t-interval over rounds. Its --quick mode needs
    vLLM's environment and four engines (minutes): it ran by hand, see docs/guides/vllm.md."""
    import importlib.util
    import math

    spec = importlib.util.spec_from_file_location("vllm_throughput", BENCHMARKS / "vllm_throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    base = [10.0, 20.0, 40.0]
    other = [11.0, 22.0, 44.0]  # 1.1x the base in every round, though the rounds differ fourfold
    keys = ("batch1", "concurrent4", "batch1 per cpu-second", "concurrent4 per cpu-second")

    def entry(values):
        return {"batch1": sorted(values)[1], "concurrent4": sorted(values)[1], "rounds": dict.fromkeys(keys, values)}

    text = module.table({"base (transformers backend)": entry(base), "kha": entry(other)}, 4, paired=True)
    row = next(line for line in text.splitlines() if line.startswith("| kha |"))
    assert row.count("1.100x") == 4, row  # tokens/s and per CPU-second, batch 1 and concurrent
    assert "[" not in row, "equal ratios in every round have no spread: no interval"
    noisy = [11.0, 18.0, 44.0]
    text = module.table({"base (transformers backend)": entry(base), "kha": entry(noisy)}, 4, paired=True)
    row = next(line for line in text.splitlines() if line.startswith("| kha |"))
    mean = math.exp(sum(math.log(o / b) for o, b in zip(noisy, base, strict=True)) / 3)
    assert f"{mean:.3f}x [" in row, row


def test_code_corpus_writes_every_module_once_in_path_order(tmp_path):
    """benchmarks/code_corpus.py, the second training domain of the adapter A/B: every non-empty module of the
    package in sorted path order, decoded as Python decodes it (a latin-1 coding cookie), links out of the package
    skipped; readable by `kha ab --data`. Never over an existing file; a module or a missing package: one line."""
    from kha_hf.training.data import read_documents

    package = tmp_path / "src" / "fakepkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("VERSION = 1\n")
    (package / "b.py").write_bytes("# -*- coding: latin-1 -*-\nNAME = 'café'\n".encode("latin-1"))
    (package / "sub" / "__init__.py").write_text("")  # empty: dropped
    (package / "sub" / "a.py").write_text("def f():\n    return 'ü'\n")
    (tmp_path / "outside.py").write_text("SECRET = 1\n")
    (package / "link.py").symlink_to(tmp_path / "outside.py")  # out of the package: skipped
    expected = ["VERSION = 1\n", "# -*- coding: latin-1 -*-\nNAME = 'café'\n", "def f():\n    return 'ü'\n"]

    def corpus(*args):
        env = {**os.environ, "PYTHONPATH": str(tmp_path / "src")}
        command = [sys.executable, str(BENCHMARKS / "code_corpus.py"), *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)

    out = tmp_path / "code.jsonl"
    run = corpus(str(out), "--package", "fakepkg")
    assert run.returncode == 0, run.stderr
    assert "wrote 3 modules of fakepkg (fakepkg, version unknown)" in run.stdout
    assert read_documents([str(out)]) == expected
    for args, message in [
        ([str(out), "--package", "fakepkg"], "exists"),  # never overwritten
        ([str(tmp_path / "m.jsonl"), "--package", "fakepkg.b"], "is a module"),
        ([str(tmp_path / "n.jsonl"), "--package", "no_such_package"], "cannot import"),
        ([str(tmp_path / "missing" / "o.jsonl"), "--package", "fakepkg"], "is not a folder"),
    ]:
        refused = corpus(*args)
        assert refused.returncode == 2 and message in refused.stderr and len(refused.stderr.strip().splitlines()) <= 3
    assert read_documents([str(out)]) == expected  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["code.jsonl", "outside.py", "src"]  # nothing half-written
