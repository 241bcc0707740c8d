"""Pretraining data at scale: memory flat in the corpus size, tokenizing on every core, a loader faster than training.

1. Preparing: tokens/s and peak RSS of today's in-memory path (`training.data.pack`: one core, Python lists)
   against `kha tokenize` (its workers, a token file on disk), on the same text (Shakespeare repeated).
2. Training from a prepared corpus: `kha train cpu-tiny --data DIR --mode full` for 20 steps, from a small and a
   large prepared corpus (the large one eight times the small), each in a fresh process; peak RSS of each run and
   their ratio. The two corpora hold the real tokens of (1), tiled to size.
3. The loader alone (the block reader, the global order, a DataLoader as Trainer builds it) against what training
   consumes: tokens/s of each, from the large corpus.

Each measurement runs in a fresh interpreter that reports its own peak RSS (ru_maxrss of that child: os.wait4),
so the numbers include the interpreter and its imports. This driver imports no torch.

    python benchmarks/corpus_scale.py             # 20 MB of text; 0.5 GB and 4 GB prepared corpora
    python benchmarks/corpus_scale.py --quick     # 1 MB of text; 8 MB and 64 MB corpora, 4 steps, for CI
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHUNK_BYTES = 16 << 20  # kha_hf/data/chunks.py

PACK = r"""
import json, resource, sys, time
from pathlib import Path
from transformers import AutoTokenizer
from kha_hf.training.data import pack
tok = AutoTokenizer.from_pretrained(sys.argv[1])
docs = [p.read_text() for p in sorted(Path(sys.argv[2]).glob("*.md"))]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
blocks = pack(docs, tok, 256)
seconds = time.perf_counter() - start
print(json.dumps({"tokens": blocks.numel(), "seconds": seconds,
                  "rss_growth_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}))
"""

LOADER = r"""
import json, sys, time
import torch
from kha_hf.data.corpus import open_corpus
from kha_hf.data.order import GlobalBlockOrder
blocks = open_corpus(sys.argv[1]).blocks("train", 256)
loader = torch.utils.data.DataLoader(blocks, batch_size=8, sampler=GlobalBlockOrder(len(blocks), 0), drop_last=True)
start, tokens = time.perf_counter(), 0
for i, batch in enumerate(loader):
    tokens += batch["input_ids"].numel()
    if i == 2000:
        break
print(json.dumps({"tokens_per_second": tokens / (time.perf_counter() - start)}))
"""


def measured(command: list[str], env: dict | None = None) -> tuple[str, float, float]:
    """COMMAND run under a wrapper that reports that command's own peak RSS (Linux keeps a child's maximum)."""
    wrapper = (
        "import json, resource, subprocess, sys, time; t = time.perf_counter(); "
        "p = subprocess.run(sys.argv[1:], capture_output=True); "
        "sys.stderr.buffer.write(p.stderr[-4000:]) if p.returncode else None; "
        "print(json.dumps({'rc': p.returncode, 'rss': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, "
        "'seconds': time.perf_counter() - t, 'out': p.stdout.decode(errors='replace')[-20000:]}))"
    )
    proc = subprocess.run([sys.executable, "-c", wrapper, *command], capture_output=True, text=True, env=env)
    result = json.loads(proc.stdout)
    if result["rc"] != 0:
        sys.exit(f"{' '.join(command[:6])} failed (exit {result['rc']}):\n{proc.stderr[-3000:]}")
    return result["out"], result["rss"], result["seconds"]


def shakespeare_text(folder: Path, megabytes: float) -> None:
    """Shakespeare's plays as .md files, repeated to about MEGABYTES of text."""
    sys.path.insert(0, str(ROOT))
    from kha_hf.common.assets import shakespeare_files

    plays = [p.read_text() for p in shakespeare_files()]
    folder.mkdir(parents=True)
    written, i = 0, 0
    while written < megabytes * 1e6:
        text = plays[i % len(plays)]
        (folder / f"{i:05d}.md").write_text(text)
        written, i = written + len(text.encode()), i + 1


def tiled_corpus(real: Path, dst: Path, gigabytes: float) -> int:
    """A prepared corpus of about GIGABYTES: REAL's train tokens tiled (whole copies of the file), its evaluation
    splits kept; the manifest says so. Returns the file size."""
    manifest = json.loads((real / "manifest.json").read_text())
    item = 2 if manifest["dtype"] == "uint16" else 4
    data = (real / "tokens.bin").read_bytes()
    train_end = manifest["splits"]["train"][1] * item
    train, evaluation = data[:train_end], data[train_end:]
    copies = max(1, int(gigabytes * 2**30 // len(train)))
    dst.mkdir(parents=True)
    shutil.copytree(real / "tokenizer", dst / "tokenizer")
    # the chunk digests training checks as it reads (kha_hf/data/chunks.py's format: a SHA-256 a 16 MiB, in
    # tokens.chunks), computed here without importing kha_hf (this driver imports no torch)
    digests, current, filled = bytearray(), hashlib.sha256(), 0
    with open(dst / "tokens.bin", "wb") as f:
        for part in [train] * copies + [evaluation]:
            f.write(part)
            view = memoryview(part)
            while len(view):
                take = min(len(view), CHUNK_BYTES - filled)
                current.update(view[:take])
                filled, view = filled + take, view[take:]
                if filled == CHUNK_BYTES:
                    digests += current.digest()
                    current, filled = hashlib.sha256(), 0
    if filled:
        digests += current.digest()
    (dst / "tokens.chunks").write_bytes(bytes(digests))
    tokens = (copies * len(train) + len(evaluation)) // item
    train_tokens = copies * len(train) // item
    eval_tokens = len(evaluation) // item // 2
    manifest.update(
        tokens=tokens,
        tokens_sha256=None,
        chunks_sha256=hashlib.sha256(digests).hexdigest(),
        splits={
            "train": [0, train_tokens],
            "validation": [train_tokens, train_tokens + eval_tokens],
            "heldout": [train_tokens + eval_tokens, tokens],
        },
        split_rule=f"benchmark: the train split of {real.name} tiled {copies} times",
    )
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return (dst / "tokens.bin").stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    text_mb, sizes = (1, (0.0078125, 0.0625)) if args.quick else (20, (0.5, 4.0))
    steps = "4" if args.quick else "20"  # the quick run checks that the script works, not a rate
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    kha = [sys.executable, "-m", "kha_hf"]
    print(f"# corpus scale, {datetime.date.today()}, {os.cpu_count()} {platform.machine()} cores, {platform.system()}")
    with tempfile.TemporaryDirectory(prefix="kha-corpus-bench-") as tmp:
        tmp = Path(tmp)
        shakespeare_text(tmp / "text", text_mb)
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; sys.path.insert(0, sys.argv[2]); "
                "from kha_hf.training.tokenizer import train_bpe_tokenizer as t; from kha_hf.training.data import "
                "read_documents as r; t(r(None), 4096).save_pretrained(sys.argv[1])",
                str(tmp / "tok"),
                str(ROOT),
            ],
            check=True,
            env=env,
        )
        out, pack_rss, _ = measured([sys.executable, "-c", PACK, str(tmp / "tok"), str(tmp / "text")], env)
        pack_result = json.loads(out.strip().splitlines()[-1])
        tok_out, tok_rss, tok_seconds = measured(
            [*kha, "tokenize", str(tmp / "text"), "--tokenizer", str(tmp / "tok"), "--output", str(tmp / "real")], env
        )
        tokens = json.loads((tmp / "real" / "manifest.json").read_text())["tokens"]
        print(f"\n## 1. Preparing {text_mb} MB of text ({tokens:,} tokens)\n")
        print("| path | tokens/s | peak RSS (MiB) | bytes a token held |")
        print("|---|---|---|---|")
        print(
            f"| in memory (`pack`, 1 core) | {pack_result['tokens'] / pack_result['seconds']:,.0f} | {pack_rss:.0f} | "
            f"{pack_result['rss_growth_mib'] * 2**20 / pack_result['tokens']:.0f} (RSS growth) |"
        )
        phase_rate = next(line for line in tok_out.splitlines() if line.startswith("tokenized at ")).split()[2]
        print(
            f"| `kha tokenize` ({os.cpu_count()} workers) | {phase_rate} | {tok_rss:.0f} (main process) | 2 (on disk) |"
        )
        print(f"| `kha tokenize`, whole command (start-up and imports too) | {tokens / tok_seconds:,.0f} | | |")

        rows, train_rates = [], []
        for gigabytes in sizes:
            corpus = tmp / f"corpus-{gigabytes:g}"
            size = tiled_corpus(tmp / "real", corpus, gigabytes)
            out_dir = tmp / f"run-{gigabytes:g}"
            _, rss, seconds = measured(
                [
                    *kha,
                    "train",
                    "cpu-tiny",
                    "--data",
                    str(corpus),
                    "--mode",
                    "full",
                    "--max-steps",
                    steps,
                    "--seq-len",
                    "256",
                    "--batch-size",
                    "8",
                    "--max-eval-blocks",
                    "8",
                    "--output",
                    str(out_dir),
                ],
                env,
            )
            metrics = json.loads((out_dir / "train_results.json").read_text())
            rate = metrics["train_samples_per_second"] * 256
            train_rates.append(rate)
            rows.append((size, rss, rate))
            shutil.rmtree(out_dir)
            if gigabytes != sizes[-1]:
                shutil.rmtree(corpus)
        print(f"\n## 2. `kha train cpu-tiny --data DIR --mode full`, {steps} steps of 8 x 256 tokens\n")
        print("| prepared corpus | peak RSS (MiB) | training tokens/s |")
        print("|---|---|---|")
        for size, rss, rate in rows:
            print(f"| {size / 2**30:.3f} GiB | {rss:.0f} | {rate:,.0f} |")
        print(f"\npeak RSS, large / small: {rows[-1][1] / rows[0][1]:.3f}x (corpus {rows[-1][0] / rows[0][0]:.1f}x)")

        out, _, _ = measured([sys.executable, "-c", LOADER, str(tmp / f"corpus-{sizes[-1]:g}")], env)
        loader_rate = json.loads(out.strip().splitlines()[-1])["tokens_per_second"]
        print("\n## 3. The loader alone against training, large corpus\n")
        print("| reader | tokens/s |")
        print("|---|---|")
        print(f"| block reader + global order + DataLoader (batches of 8 x 256) | {loader_rate:,.0f} |")
        print(f"| training consumes (cpu-tiny, full) | {train_rates[-1]:,.0f} |")
        print(f"\nloader / training: {loader_rate / train_rates[-1]:,.0f}x")


if __name__ == "__main__":
    main()
