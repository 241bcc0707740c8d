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
