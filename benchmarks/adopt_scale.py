"""Adopting token files (`kha tokenize FILE --from-tokens nanogpt`): memory flat in the file's size, linked or copied.

A synthetic nanoGPT train.bin (uint16 ids below a 4,096-id BPE tokenizer's size, an EOS about every 500 tokens) at
two sizes, each adopted in a fresh process twice: hard-linked (the default) and with --copy (a new tokens.bin). Each
child's peak RSS (ru_maxrss of that child: the interpreter and its imports included), its wall time, the rate of the
checking pass it reports, and the ratio of the large file's peak RSS to the small one's: flat memory reads ~1.0x
while the file grows 4x. This driver imports no torch.

    python benchmarks/adopt_scale.py            # 64 MiB and 256 MiB files
    python benchmarks/adopt_scale.py --quick    # 16 MiB and 64 MiB
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus_scale import ROOT, measured  # noqa: E402 (the same child-RSS wrapper)

VOCAB, EOS = 4096, 0  # the tokenizer built below: train_bpe_tokenizer's EOS is id 0


def nanogpt_file(path: Path, megabytes: int) -> None:
    """MEGABYTES (MiB) of uint16 ids, written 16 MiB at a time (this driver's memory stays small too)."""
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        for _ in range(megabytes // 16):
            ids = rng.integers(1, VOCAB, 8 << 20, dtype=np.uint16)
            ids[rng.random(ids.size) < 1 / 500] = EOS
            f.write(ids.tobytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sizes = (16, 64) if args.quick else (64, 256)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    kha = [sys.executable, "-m", "kha_hf"]
    print(f"# adopt scale, {datetime.date.today()}, {os.cpu_count()} {platform.machine()} cores, {platform.system()}")
    with tempfile.TemporaryDirectory(prefix="kha-adopt-bench-") as tmp:
        tmp = Path(tmp)
        build = (
            "import sys; sys.path.insert(0, sys.argv[2]); from kha_hf.training.tokenizer import train_bpe_tokenizer "
            "as t; from kha_hf.training.data import read_documents as r; "
            f"t(r(None), {VOCAB}).save_pretrained(sys.argv[1])"
        )
        subprocess.run([sys.executable, "-c", build, str(tmp / "tok"), str(ROOT)], check=True, env=env)
        rows = []
        for megabytes in sizes:
            source = tmp / f"train-{megabytes}.bin"
            nanogpt_file(source, megabytes)
            for how, extra in (("hard link", []), ("--copy", ["--copy"])):
                out = tmp / "corpus"
                command = [*kha, "tokenize", str(source), "--from-tokens", "nanogpt", "--tokenizer", str(tmp / "tok")]
                text, rss, seconds = measured([*command, "--output", str(out), *extra], env)
                rate = re.search(r"checked at ([\d,]+) MiB/s", text).group(1)
                rows.append((megabytes, how, rss, seconds, rate))
                shutil.rmtree(out)
            source.unlink()
    print("\n| source | how | peak RSS (MiB) | wall (s) | checking pass (MiB/s) |")
    print("|---|---|---|---|---|")
    for megabytes, how, rss, seconds, rate in rows:
        print(f"| {megabytes} MiB | {how} | {rss:.0f} | {seconds:.1f} | {rate} |")
    print()
    for how in ("hard link", "--copy"):
        small, large = (row[2] for row in rows if row[1] == how)
        print(f"peak RSS, large / small ({how}): {large / small:.3f}x (file {sizes[1] / sizes[0]:.0f}x)")


if __name__ == "__main__":
    main()
