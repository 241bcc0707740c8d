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
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNS = Path(__file__).resolve().parents[1] / "docs" / "benchmark_runs"


def machine() -> str:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} {platform.machine()} cores, {memory:.0f} GiB, {platform.system()} {platform.release()}"


def run_teed(command: list[str]) -> tuple[int, bytes]:
    """Run COMMAND, passing its standard output through as it comes (progress stays visible) and keeping its bytes
    as printed (carriage returns and bytes that are not UTF-8 included)."""
    kept = bytearray()
    with subprocess.Popen(command, stdout=subprocess.PIPE) as process:
        for chunk in iter(lambda: process.stdout.read1(65536), b""):
            kept += chunk
            sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
    return process.returncode, bytes(kept)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--" or not re.fullmatch(r"[A-Za-z0-9_]+", argv[0]):
        sys.exit(__doc__)
    name, command = argv[0], argv[2:]
    start = time.perf_counter()
    try:
        returncode, printed = run_teed(command)
    except OSError as err:  # not found, not executable
        print(f"record.py: cannot run {shlex.join(command)}: {err.strerror or err}: nothing recorded", file=sys.stderr)
        return 127
    if returncode != 0:
        print(f"record.py: {shlex.join(command)} exited {returncode}: nothing recorded", file=sys.stderr)
        return returncode or 1
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = f"$ {shlex.join(command)}\n# {now}; {machine()}; wall {time.perf_counter() - start:.0f} s\n\n"
    RUNS.mkdir(parents=True, exist_ok=True)
    # a new file of our own (O_EXCL: never a link someone left there), renamed over the record when whole, so two
    # runs of one name cannot mix, and a failed one leaves the previous record
    fd, partial = tempfile.mkstemp(prefix=f".{name}.", suffix=".partial", dir=RUNS)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(head.encode() + printed)
        os.chmod(partial, 0o644)
        os.replace(partial, RUNS / f"{name}.txt")
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    print(f"recorded {RUNS / f'{name}.txt'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
