"""The benchmark scripts keep working: each runs its --quick mode (no timing is asserted, only that it reports)."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize(
    "script, extra_args, expected",
    [
        ("train_step.py", [], ["ratio vs baseline", "mlp_v_linear_qk", "saved for backward"]),
        ("decode.py", ["--compile"], ["linear_qkv folded", "aten ops / step", "torch.compile + static cache"]),
        ("convert_memory.py", [], ["kha convert (copy)", "naive load-modify-save", "kha fold"]),
        ("cli_startup.py", [], ["ratio vs transformers --help", "kha train --help", "argument error"]),
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
    vLLM's environment and four engines (minutes): it ran by hand, see README."""
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
    package, in sorted path order, readable by `kha ab --data`; an existing file is never overwritten."""
    import importlib.util

    from kha_hf.training.data import read_documents

    spec = importlib.util.spec_from_file_location("code_corpus", BENCHMARKS / "code_corpus.py")
    corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(corpus)
    package = Path(__import__("kha_hf.peft").peft.__file__).parent
    expected = [f.read_text() for f in sorted(package.rglob("*.py")) if f.read_text().strip()]
    out = tmp_path / "code.jsonl"
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "code_corpus.py"), str(out), "--package", "kha_hf.peft"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert f"wrote {len(expected)} modules of kha_hf.peft" in run.stdout
    assert read_documents([str(out)]) == expected == [t for _, t in corpus.code_documents("kha_hf.peft")]
    again = subprocess.run(
        [sys.executable, str(BENCHMARKS / "code_corpus.py"), str(out)], capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 2 and "exists" in again.stderr
    assert read_documents([str(out)]) == expected  # untouched
