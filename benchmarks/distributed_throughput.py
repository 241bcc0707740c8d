"""Training tokens/s of KHA against its baseline across processes, both arms from one prepared corpus, paired by round;
and each rank's peak memory under FSDP2 against DDP at two model sizes.

Each round trains the baseline (a stock Qwen3 of the preset's shape) and its KHA twin (the same initial weights plus
identity knocks) for the same steps on the same blocks, each in a fresh `accelerate launch` with a shipped config,
the order of the two alternating between rounds. A round's ratio is KHA's tokens/s over the baseline's in that
round; the table gives their geometric mean and the smallest and largest round, and names the engine that ran.
Under an FSDP2 config the model is sharded at load time by transformers, as `kha train` does (training/parallel.py):
the same calls on CPUs (gloo) and GPUs.

    python benchmarks/distributed_throughput.py           # CPU: 2 processes (gloo), cpu-tiny, fp32, 3 rounds, FSDP2
    python benchmarks/distributed_throughput.py --ddp     # the same under DDP
    python benchmarks/distributed_throughput.py --quick   # 1 round of 4 steps
    python benchmarks/distributed_throughput.py --memory  # peak RSS per rank, FSDP2 and DDP, cpu-tiny and gpu-small
    python benchmarks/distributed_throughput.py --gpu     # a GPU machine: FSDP2, 1 process per GPU, gpu-small, bf16

--gpu is the script for a GPU machine: FSDP2 with bf16 mixed precision, both arms, in under 10 minutes on one H100
(2 rounds x 2 arms x 60 steps of 16 x 1024 tokens, gpu-small); not run on a GPU yet.
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
CONFIGS = ROOT / "examples" / "accelerate"


def worker(arm: str, preset_name: str, corpus: str, steps: int, batch: int, seq: int, bf16: bool, out: str) -> None:
    """One arm's run, in each process of `accelerate launch`: train STEPS steps and print tokens/s and every rank's
    peak resident memory (rank 0)."""
    import copy
    import resource

    import torch
    from transformers import AutoModelForCausalLM

    from kha_hf import KHAForCausalLM
    from kha_hf.data.corpus import open_corpus
    from kha_hf.training.parallel import build_sharded, hand_over_from_accelerate, plan_from_launch
    from kha_hf.training.presets import PRESETS
    from kha_hf.training.train import paper_training_arguments
    from kha_hf.training.trainer import KHATrainer

    prepared = open_corpus(corpus)
    config = PRESETS[preset_name].config()
    config.vocab_size = prepared.manifest["tokenizer"]["size"]
    plan = plan_from_launch()  # an FSDP2 config: transformers shards the model at load time, as kha train does
    hand_over_from_accelerate(plan)
    args = paper_training_arguments(
        out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=1e-3, logging_steps=steps,
        save_strategy="no", seed=0, data_seed=0, bf16=bf16, disable_tqdm=True,
    )  # fmt: skip
    torch.manual_seed(0)

    def build():
        model = AutoModelForCausalLM.from_config(config)
        return KHAForCausalLM.from_base(copy.deepcopy(model), knock="mlp_v") if arm == "kha" else model

    if plan is None:
        model = build()
    else:
        args.world_size  # noqa: B018 (sets up the process group the build shares its folder over)
        model_class = KHAForCausalLM if arm == "kha" else AutoModelForCausalLM
        model = build_sharded(build, model_class, plan, Path(out).parent)
    trainer = KHATrainer(model=model, args=args, train_dataset=prepared.blocks("train", seq), plan=plan)
    metrics = trainer.train().metrics
    import psutil

    def local_bytes(tensor) -> int:
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        return tensor.numel() * tensor.element_size()

    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    held = sum(local_bytes(p) + (local_bytes(p.grad) if p.grad is not None else 0) for p in model.parameters())
    held += sum(local_bytes(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))
    mine = {
        "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # MiB (Linux: KiB), the whole run
        "now": psutil.Process().memory_info().rss / 2**20,  # after the last step
        "state": held / 2**20,  # this rank's weights, gradients and AdamW moments
    }
    ranks = [mine]
    if torch.distributed.is_initialized():
        ranks = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(ranks, mine)
    if trainer.is_world_process_zero():
        rate = metrics["train_samples_per_second"] * seq
        print(json.dumps({"arm": arm, "tokens_per_second": rate, "memory": ranks}), flush=True)
    if torch.distributed.is_initialized():  # a rank that exits with the group alive aborts in gloo's destructor
        trainer.accelerator.wait_for_everyone()
        torch.distributed.destroy_process_group()


def launch(arm: str, args, corpus: Path, tmp: Path, engine: str | None = None) -> dict:
    """One arm in a fresh `accelerate launch` of ENGINE's shipped config (default: the run's); what rank 0 printed."""
    engine = engine or ("ddp" if args.ddp else "fsdp2-full")
    # the config as shipped, with this run's process count and precision written in
    text = (CONFIGS / f"{engine}.yaml").read_text()
    text = text.replace("num_processes: 2", f"num_processes: {args.processes}")
    text = text.replace("mixed_precision: 'no'", "mixed_precision: bf16" if args.gpu else "mixed_precision: 'no'")
    (tmp / "launch.yaml").write_text(text)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp / "launch.yaml")]
    command += [__file__, "--worker", arm, "--preset", args.preset, "--corpus", str(corpus), "--steps",
                str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq),
                "--out", str(tmp / arm)]  # fmt: skip
    if args.gpu:
        command.append("--bf16")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ACCELERATE_CONFIG_FILE": str(tmp / "none.yaml")}
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"{arm} failed:\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("{") and '"arm"' in x)
    engine_line = next(x for x in proc.stdout.splitlines() if "engine: " in x)
    ENGINES.add(engine_line[engine_line.index("engine: ") + 8 :])
    return json.loads(line)


ENGINES: set[str] = set()  # as kha's trainer printed them


def prepare_corpus(tmp: Path) -> Path:
    """The embedded Shakespeare, tokenized by kha tokenize with an 8,192-token BPE trained on it."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    script = (
        "import sys; from kha_hf.training.tokenizer import train_bpe_tokenizer as t; "
        "from kha_hf.training.data import read_documents as r; t(r(None), 8192).save_pretrained(sys.argv[1])"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp / "tok")], check=True, env=env, cwd=ROOT)
    plays = subprocess.run(
        [sys.executable, "-c", "from kha_hf.common.assets import shakespeare_files as s; print(s()[0].parent)"],
        capture_output=True, text=True, check=True, env=env, cwd=ROOT,
    ).stdout.strip()  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "kha_hf", "tokenize", plays, "--tokenizer", str(tmp / "tok"), "--output",
         str(tmp / "corpus")], check=True, env=env, cwd=ROOT, capture_output=True,
    )  # fmt: skip
    return tmp / "corpus"


def memory(args) -> None:
    """Each rank's peak resident memory, KHA arm, FSDP2 against DDP, at two model sizes (a few steps each)."""
    print(f"# peak RSS per rank, {datetime.date.today()}, {args.processes} processes, {platform.machine()}, KHA "
          f"(mlp_v), {args.steps} steps of {args.processes} x {args.batch} x {args.seq} tokens, fp32")  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory(prefix="kha-distributed-bench-") as tmp:
        corpus = prepare_corpus(Path(tmp))
        for preset in ("cpu-tiny", "gpu-small"):
            args.preset = preset
            memory = {engine: launch("kha", args, corpus, Path(tmp), engine)["memory"]
                      for engine in ("ddp", "fsdp2-full")}  # fmt: skip
            rows.append((preset, memory))
    print(f"\nengine: {', '.join(sorted(ENGINES))}")
    print("\nPer rank, MiB: the weights, gradients and AdamW moments it holds; its resident memory after the last")
    print("step; its peak resident memory over the whole run (imports, the load, the build of new weights).\n")
    print("| preset | DDP: state / RSS after / peak | FSDP2: state / RSS after / peak | FSDP2/DDP state | RSS after |")
    print("|---|---|---|---|---|")
    for preset, memory in rows:
        cells = {
            engine: "; ".join(f"{r['state']:,.0f} / {r['now']:,.0f} / {r['peak']:,.0f}" for r in memory[engine])
            for engine in memory
        }
        state = max(r["state"] for r in memory["fsdp2-full"]) / max(r["state"] for r in memory["ddp"])
        after = max(r["now"] for r in memory["fsdp2-full"]) / max(r["now"] for r in memory["ddp"])
        print(f"| {preset} | {cells['ddp']} | {cells['fsdp2-full']} | {state:.2f} | {after:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--ddp", action="store_true", help="DDP instead of FSDP2 (CPU)")
    parser.add_argument("--memory", action="store_true", help="peak RSS per rank, FSDP2 against DDP, two sizes")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--worker", choices=("baseline", "kha"))
    for name, kind in (("preset", str), ("corpus", str), ("steps", int), ("batch", int), ("seq", int), ("out", str)):
        parser.add_argument(f"--{name}", type=kind)
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.preset, args.corpus, args.steps, args.batch, args.seq, args.bf16, args.out)
        return
    if args.gpu:
        import torch

        args.processes, args.preset, args.steps, args.batch, args.seq = (
            torch.cuda.device_count(), "gpu-small", 60, 16, 1024,
        )  # fmt: skip
        args.ddp = False
        rounds = args.rounds or 2
    elif args.memory:
        args.processes, args.batch, args.seq, args.steps = 2, 2, 256, 3
        memory(args)
        return
    else:
        args.processes, args.preset, args.batch, args.seq = 2, "cpu-tiny", 4, 256
        args.steps = 4 if args.quick else 40
        rounds = 1 if args.quick else (args.rounds or 3)
    print(f"# training throughput, {datetime.date.today()}, {args.processes} process(es), {platform.machine()}, "
          f"preset {args.preset}, {args.steps} steps of {args.processes} x {args.batch} x {args.seq} tokens, "
          f"{'bf16' if args.gpu else 'fp32'}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kha-distributed-bench-") as tmp:
        tmp = Path(tmp)
        corpus = prepare_corpus(tmp)
        ratios = []
        for r in range(rounds):
            order = ("baseline", "kha") if r % 2 == 0 else ("kha", "baseline")
            rates = {arm: launch(arm, args, corpus, tmp)["tokens_per_second"] for arm in order}
            ratios.append(rates["kha"] / rates["baseline"])
            print(f"round {r + 1}: baseline {rates['baseline']:,.0f} tok/s, kha {rates['kha']:,.0f} tok/s, "
                  f"ratio {ratios[-1]:.3f}x")  # fmt: skip
    mean = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
    print(f"\nengine: {', '.join(sorted(ENGINES))}")
    print("\n| arms | rounds | KHA (mlp_v) / baseline tokens/s, geometric mean | smallest | largest |")
    print("|---|---|---|---|---|")
    spread = f"{min(ratios):.3f}x | {max(ratios):.3f}x"
    print(
        f"| {'DDP' if args.ddp else 'FSDP2'}, {args.processes} process(es) | {len(ratios)} | {mean:.3f}x | {spread} |"
    )


if __name__ == "__main__":
    main()
