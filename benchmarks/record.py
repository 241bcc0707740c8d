"""Run a benchmark and keep what it printed as the docs' source: docs/benchmark_runs/NAME.txt.

    python benchmarks/record.py train_step -- python benchmarks/train_step.py
    python benchmarks/record.py vllm_eager -- .venv-vllm/bin/python benchmarks/vllm_throughput.py --rounds 6

The file holds the command, the date, the machine and the wall time, then the benchmark's standard output as it
printed it. It is written only when the benchmark exits 0, and only whole (a temporary file renamed over it), so a
failed or interrupted run leaves the previous record in place. The docs' benchmark tables are copied from these
files, and tests/docs/test_benchmark_tables.py checks that every row of them stands in the file its marker names.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

RUNS = Path(__file__).resolve().parents[1] / "docs" / "benchmark_runs"


def machine() -> str:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} {platform.machine()} cores, {memory:.0f} GiB, {platform.system()} {platform.release()}"


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].replace("_", "").isalnum():
        sys.exit(__doc__)
    name, command = argv[0], argv[2:]
    start = time.perf_counter()
    run = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    sys.stdout.write(run.stdout)
    if run.returncode != 0:
        print(f"record.py: {shlex.join(command)} exited {run.returncode}: nothing recorded", file=sys.stderr)
        return run.returncode
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = f"$ {shlex.join(command)}\n# {now}; {machine()}; wall {time.perf_counter() - start:.0f} s\n\n"
    RUNS.mkdir(parents=True, exist_ok=True)
    partial = RUNS / f".{name}.txt.partial"
    partial.write_text(head + run.stdout)
    partial.replace(RUNS / f"{name}.txt")
    print(f"recorded {RUNS / f'{name}.txt'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
