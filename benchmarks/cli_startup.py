"""`kha --help` against `transformers --help`, side by side: wall time and peak RSS of each, and their ratio.

Each round runs both commands back to back (alternating which goes first), so load on a shared machine hits both;
the medians and the ratio are the result. Also times `kha <command> --help` for every subcommand and one
argument error (`kha train x --output y --max-steps 0`).

    python benchmarks/cli_startup.py            # 5 rounds
    python benchmarks/cli_startup.py --quick    # 1 round, 2 subcommands (the test suite runs this)
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

KHA = [sys.executable, "-m", "kha_hf_entry"]  # what the `kha` console script runs
COMMANDS = ["convert", "verify", "train", "ab", "eval", "inspect", "fold", "push", "serve", "demo", "assets"]
QUICK_COMMANDS = ["convert", "train"]  # each run is a fresh interpreter (~5 s here): the suite times two


def measure(cmd: list[str]) -> float:
    """Wall seconds of one run of CMD (its exit status is not checked: argument errors are timed too)."""
    start = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    return time.perf_counter() - start


def peak_rss_mib(cmd: list[str]) -> float:
    """Peak RSS of CMD, measured from a fresh Python parent (RUSAGE_CHILDREN only ever grows)."""
    probe = (
        f"import resource, subprocess; subprocess.run({cmd!r}, capture_output=True); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    return int(out.stdout.strip() or 0) / 1024  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one round, two subcommands")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    beside = Path(sys.executable).parent / "transformers"  # the same environment's console script
    transformers_cli = str(beside) if beside.exists() else shutil.which("transformers")
    reference = [transformers_cli, "--help"] if transformers_cli else [sys.executable, "-m", "transformers", "--help"]

    times: dict[str, list[float]] = {"transformers --help": [], "kha --help": []}
    for i in range(rounds):
        pair = [("transformers --help", reference), ("kha --help", [*KHA, "--help"])]
        for name, cmd in pair if i % 2 == 0 else reversed(pair):
            times[name].append(measure(cmd))
    rss = {"transformers --help": peak_rss_mib(reference), "kha --help": peak_rss_mib([*KHA, "--help"])}
    for command in QUICK_COMMANDS if args.quick else COMMANDS:
        times[f"kha {command} --help"] = [measure([*KHA, command, "--help"]) for _ in range(rounds)]
    error = [*KHA, "train", "x", "--output", "y", "--max-steps", "0"]
    times["kha train (argument error)"] = [measure(error) for _ in range(rounds)]

    base = statistics.median(times["transformers --help"])
    print(
        f"# CLI startup\n{datetime.date.today()}, {platform.machine()}, python {platform.python_version()}, "
        f"{rounds} round(s)\n"
    )
    print("| command | median wall (s) | ratio vs transformers --help | peak RSS (MiB) |")
    print("|---|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        memory = f"{rss[name]:.0f}" if name in rss else ""
        print(f"| {name} | {median:.2f} | {median / base:.2f}x | {memory} |")


if __name__ == "__main__":
    main()
