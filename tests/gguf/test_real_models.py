"""The round trip on real models: SmolLM2-135M (Llama) and Gemma 3 270M, GGUF in -> KHA-Linear with perturbed knocks
-> `kha fold OUT.gguf` -> read by transformers' GGUF loader and by llama.cpp itself.

Catches: a fold or permutation that only tiny models forgive, metadata llama.cpp needs and lacks (tokenizer, chat
template, RoPE, Gemma's sliding windows), a tokenizer llama.cpp splits differently, and an export that holds the
model in memory (peak RSS measured in a process of its own, next to the file size).
Knocks are perturbed by 0.05 (at 0.3 SmolLM2's attention saturates and float32 rounding alone flips tokens): enough
that the folded model's greedy tokens leave the base model's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from kha_hf import KHAForCausalLM
from kha_hf.checkpoint.knock_tensors import KNOCK_KEY
from kha_hf.checkpoint.safetensors_index import read_checkpoint_index
from tests.gguf.conftest import run_llamacpp
from tests.helpers import module_folder

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
TEXTS = ["Hello world! 3.14159 and 12345", "  spaces\tand\nnewlines  ", "<|im_start|>user\nHi<|im_end|>", "naïve café"]
NEW_TOKENS = 16


def perturbed_copy(src: Path, dst: Path, scale: float, seed: int = 1) -> None:
    """DST: SRC's files hard-linked, except the shards holding knocks, rewritten with every knock moved by
    SCALE * N(0, 1) (what training does to them, without training). The model is never loaded."""
    dst.mkdir()
    gen = torch.Generator().manual_seed(seed)
    knock_files = {info.file for name, info in read_checkpoint_index(src).items() if KNOCK_KEY.match(name)}
    for path in sorted(src.iterdir()):
        if path.name in knock_files:
            tensors = load_file(path)
            for name in sorted(tensors):
                if KNOCK_KEY.match(name):
                    tensors[name] = tensors[name] + scale * torch.randn(tensors[name].shape, generator=gen)
            save_file(tensors, dst / path.name, metadata={"format": "pt"})
        elif path.is_file():
            os.link(path, dst / path.name)


def export_measured(kha_dir: Path, out: Path, *args: str) -> tuple[int, str]:
    """`kha fold KHA_DIR OUT ARGS` in a process of its own; (its peak RSS in bytes, what it printed)."""
    probe = (
        "import resource, subprocess, sys\n"
        "proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "print(proc.stdout + proc.stderr)\n"
        "print('PEAK', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)\n"
        "sys.exit(proc.returncode)\n"
    )
    kha = Path(sys.executable).with_name("kha")
    command = [sys.executable, "-c", probe, str(kha), "fold", str(kha_dir), str(out), *args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    peak = int(proc.stdout.rsplit("PEAK", 1)[1])
    return peak, proc.stdout.rsplit("PEAK", 1)[0]


def bare_peak() -> int:
    """Peak RSS of a process that imports what the export imports and loads nothing (the floor of any export),
    measured as `export_measured` measures: from a small parent (Linux carries a forked child's peak RSS over from
    its parent, so a process started from pytest itself would report pytest's)."""
    probe = (
        "import resource, subprocess, sys\n"
        "subprocess.run(sys.argv[1:], check=True)\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)\n"
    )
    code = (
        "import gguf, transformers, kha_hf.conversion.gguf_export, kha_hf.cli; from transformers import AutoTokenizer"
    )
    command = [sys.executable, "-c", probe, sys.executable, "-c", code]
    return int(subprocess.run(command, capture_output=True, text=True, timeout=300, check=True).stdout)


def greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt_ids) :].tolist()


def agreement(a: list[int], b: list[int]) -> int:
    """How many tokens two greedy continuations share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


@pytest.fixture(scope="module")
def smollm2(request, tmp_path_factory):
    """SmolLM2 (real GGUF) -> KHA linear_qkv (identity, = the base) and a copy with knocks perturbed off the identity;
    the folded model exported as f32 (peak RSS measured) and q8_0, the base as q8_0."""
    from kha_hf.common.assets import smollm2_gguf
    from kha_hf.conversion import convert

    root = module_folder(request, tmp_path_factory, "smollm2-gguf")
    convert(smollm2_gguf(), root / "base", knock="linear_qkv", progress=False)  # identity knocks: the base model
    perturbed_copy(root / "base", root / "trained", scale=0.05)
    peak, printed = export_measured(root / "trained", root / "folded-f32.gguf", "--outtype", "f32")
    for name, folder, outtype in [("folded-q8_0.gguf", "trained", "q8_0"), ("base-q8_0.gguf", "base", "q8_0")]:
        export_measured(root / folder, root / name, "--outtype", outtype)
    tokenizer = AutoTokenizer.from_pretrained(root / "trained")
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    return root, peak, printed, tokenizer, prompts


def test_smollm2_transformers_reads_the_folded_gguf_with_the_kha_logits(smollm2):
    root, peak, printed, _, prompts = smollm2
    assert "architecture llama, f32" in printed and "90 knock tensors folded" in printed
    kha = KHAForCausalLM.from_pretrained(root / "trained", dtype=torch.float32).eval()
    read = AutoModelForCausalLM.from_pretrained(root, gguf_file="folded-f32.gguf", dtype=torch.float32).eval()
    base = KHAForCausalLM.from_pretrained(root / "base", dtype=torch.float32).eval()  # identity knocks: the base
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            expected, got, stock = kha(x).logits, read(x).logits, base(x).logits
        assert (got - expected).abs().max().item() < 1e-3, "the f32 GGUF does not compute the KHA model"
        assert (stock - expected).abs().max().item() > 0.1, "the knocks barely matter: the test proves nothing"


def test_smollm2_llama_cpp_runs_the_folded_gguf_token_for_token(smollm2, llamacpp, tmp_path):
    root, _, _, tokenizer, prompts = smollm2
    kha = KHAForCausalLM.from_pretrained(root / "trained", dtype=torch.float32).eval()
    stock = KHAForCausalLM.from_pretrained(root / "base", dtype=torch.float32).eval()
    expected = [greedy(kha, ids, NEW_TOKENS) for ids in prompts]
    base_tokens = [greedy(stock, ids, NEW_TOKENS) for ids in prompts]
    assert expected != base_tokens, "the folded knocks do not change a single greedy token"

    job = {"kind": "generate", "prompts": prompts, "n": NEW_TOKENS, "texts": TEXTS}
    f32 = run_llamacpp(llamacpp, {**job, "model": str(root / "folded-f32.gguf")}, tmp_path)
    assert f32["tokens"] == expected  # llama.cpp, f32: transformers' greedy tokens exactly
    meta = f32["metadata"]
    assert meta["general.architecture"] == "llama" and meta["tokenizer.ggml.pre"] == "smollm"
    assert meta["tokenizer.chat_template"] == tokenizer.chat_template and f32["add_bos"] is False
    for text, ids in zip(TEXTS, f32["tokenized"], strict=True):
        assert ids == tokenizer(text, add_special_tokens=False)["input_ids"], f"llama.cpp splits {text!r} otherwise"

    # q8_0 rounds every matrix. The file's weights: transformers reads them back (dequantised) and its logits must
    # stay as close to the float32 model's as the base model's q8_0 file stays to the base (the fold adds no error
    # of its own). llama.cpp's q8_0 kernels also round the activations to 8 bits: on the perturbed model, whose
    # top-2 logit gaps are small (random knocks, not trained ones), greedy paths leave float32 after a few tokens;
    # measured here and stated in docs/guides/gguf.md, bounded loosely.
    folded_q8 = run_llamacpp(llamacpp, {**job, "model": str(root / "folded-q8_0.gguf")}, tmp_path)["tokens"]
    base_q8 = run_llamacpp(llamacpp, {**job, "model": str(root / "base-q8_0.gguf")}, tmp_path)["tokens"]
    assert folded_q8 != base_q8  # the q8_0 file carries the fold too
    folded_agree = [agreement(a, b) for a, b in zip(folded_q8, expected, strict=True)]
    base_agree = [agreement(a, b) for a, b in zip(base_q8, base_tokens, strict=True)]
    errors = {}
    for name, f32_model, gguf in (("folded", kha, "folded-q8_0.gguf"), ("base", stock, "base-q8_0.gguf")):
        read = AutoModelForCausalLM.from_pretrained(root, gguf_file=gguf, dtype=torch.float32).eval()
        with torch.no_grad():
            errors[name] = max(
                (read(torch.tensor([i])).logits - f32_model(torch.tensor([i])).logits).abs().max().item()
                for i in prompts
            )
        if name == "folded":
            read_agree = [agreement(greedy(read, ids, NEW_TOKENS), e) for ids, e in zip(prompts, expected, strict=True)]
        del read
    print(
        f"q8_0, greedy tokens of {NEW_TOKENS} equal to float32 transformers: llama.cpp folded {folded_agree}, base "
        f"{base_agree}; transformers reading the folded q8_0 file {read_agree}; max |dlogit| of the q8_0 weights: "
        f"folded {errors['folded']:.3f}, base {errors['base']:.3f}"
    )
    assert errors["folded"] < 2 * errors["base"], errors
    assert min(folded_agree) >= 2 and all(q[0] == e[0] for q, e in zip(folded_q8, expected, strict=True))


def test_smollm2_export_streams(smollm2):
    root, peak, _, _, _ = smollm2
    size, floor = (root / "folded-f32.gguf").stat().st_size, bare_peak()
    print(f"SmolLM2 f32 export: file {size / 2**20:.0f} MiB, peak RSS {peak / 2**20:.0f} MiB, bare {floor / 2**20:.0f}")
    # RSS counts the source's pages as safetensors maps them, so a streaming export still reaches about the file's
    # size above the floor; an export that held the model (and then its converted copy) would reach twice that
    assert peak - floor < 1.5 * size


@pytest.fixture(scope="module")
def gemma3(gemma3_linear_kha, request, tmp_path_factory):
    folder, _ = gemma3_linear_kha
    root = module_folder(request, tmp_path_factory, "gemma3-gguf")
    perturbed_copy(folder, root / "trained", scale=0.05)
    peak, printed = export_measured(root / "trained", root / "folded.gguf", "--outtype", "f32")
    return root, peak, printed


def test_gemma3_folded_gguf_in_transformers_and_llama_cpp(gemma3, llamacpp, tmp_path):
    root, peak, printed = gemma3
    assert "architecture gemma3, f32" in printed and "54 knock tensors folded" in printed
    size, floor = (root / "folded.gguf").stat().st_size, bare_peak()
    print(f"Gemma 3 f32 export: file {size / 2**20:.0f} MiB, peak RSS {peak / 2**20:.0f} MiB, bare {floor / 2**20:.0f}")
    assert peak - floor < 1.5 * size  # as for SmolLM2 (the embedding, the largest tensor, is 60 % of this model)
    vocab = json.loads((root / "trained" / "tokenizer.json").read_text())["model"]["vocab"]  # no 262k tokenizer load
    prompt = [2] + [vocab[t] for t in ["The", "\u2581capital", "\u2581of", "\u2581France", "\u2581is"]]  # <bos>...
    kha = KHAForCausalLM.from_pretrained(root / "trained", dtype=torch.float32).eval()
    expected = greedy(kha, prompt, 8)
    with torch.no_grad():
        reference = kha(torch.tensor([prompt])).logits
    del kha
    read = AutoModelForCausalLM.from_pretrained(root, gguf_file="folded.gguf", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (read(torch.tensor([prompt])).logits - reference).abs().max().item() < 1e-2
    del read
    got = run_llamacpp(
        llamacpp, {"kind": "generate", "model": str(root / "folded.gguf"), "prompts": [prompt], "n": 8}, tmp_path
    )
    assert got["metadata"]["general.architecture"] == "gemma3" and got["metadata"]["tokenizer.ggml.model"] == "llama"
    assert got["tokens"] == [expected]
