"""Shared parts of the GGUF export tests: tiny KHA checkpoints of the exportable families, and llama.cpp.

llama.cpp runs from `.venv-llamacpp` (`bash scripts/install.sh llamacpp`: llama-cpp-python 0.3.36 built from source)
or $KHA_LLAMACPP_PYTHON, in subprocesses (`llamacpp_worker.py`): kha_hf is not installed there. Without it the
llama.cpp tests skip, naming the command that makes it; with KHA_REQUIRE_LLAMACPP=1 (CI) they fail instead.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from tests.helpers import COMMON, randomize_knocks, side_environment

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("llamacpp_worker.py")
VOCAB = 320  # the tiny models' embedding rows; the tiny tokenizer has 300 tokens (43 merges), the rest are padding

# Tiny configs of the exportable families, each as llama.cpp's graph can run it (no sliding window where that graph
# has none; Gemma 3 with head_dim = query_pre_attn_scalar, its default sliding-window pattern, a window of 5 tokens
# so that 12-token prompts cross it); biases and norm weights are randomised by `tiny_base`. transformers' GGUF
# loader reads neither Llama's attention_bias nor Qwen3's head_dim from a GGUF file (it takes the config defaults):
# the tests that read back with it keep those at their defaults; llama.cpp's test adds Llama biases (LLAMA_BIAS).
EXPORTABLE: dict[str, dict] = {
    "llama": dict(),
    "mistral": dict(sliding_window=None),  # llama.cpp runs Mistral as Llama: no window
    "qwen2": dict(),
    "qwen3": dict(),  # head_dim 128, Qwen3Config's default
    "phi3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "gemma3_text": dict(
        head_dim=256, query_pre_attn_scalar=256, sliding_window=5, pad_token_id=0, bos_token_id=2, eos_token_id=1
    ),
}


def tiny_tokenizer(folder: Path) -> None:
    """A byte-level BPE with merges (llama.cpp's BPE tokenizer needs some): 300 ids."""
    from kha_hf.training.tokenizer import train_bpe_tokenizer

    train_bpe_tokenizer(["the quick brown fox jumps over the lazy dog " * 20], vocab_size=300).save_pretrained(folder)


LLAMA_BIAS = dict(attention_bias=True)  # Llama's q/k row permutation must move the biases too


def tiny_base(family: str, seed: int = 0, **overrides):
    """A random base model of FAMILY (EXPORTABLE), biases and norm weights off their init, in eval mode."""
    torch.manual_seed(seed)
    config = CONFIG_MAPPING[family](**{**COMMON, "vocab_size": VOCAB, **EXPORTABLE[family], **overrides})
    model = AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias") and "o_proj" not in name:  # an o_proj bias would drown the tiny models
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            elif "norm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
    return model


def tiny_kha(folder: Path, family: str, knock: str = "linear_qkv", scale: float = 0.3, **overrides):
    """FAMILY's tiny base model converted to KNOCK with the knocks perturbed by SCALE, saved with the tiny tokenizer;
    returns (kha model, base model)."""
    from kha_hf import KHAForCausalLM

    base = tiny_base(family, **overrides)
    model = KHAForCausalLM.from_base(base, knock=knock).eval()
    randomize_knocks(model, scale)
    model.save_pretrained(folder)
    tiny_tokenizer(folder)
    return model, base


@pytest.fixture(scope="session")
def llamacpp() -> Path:
    """The llama.cpp environment's python, after checking that llama_cpp imports there."""
    return side_environment(
        "llama.cpp", ".venv-llamacpp", "llama_cpp", "KHA_LLAMACPP_PYTHON", "KHA_REQUIRE_LLAMACPP", "llamacpp"
    )


def run_llamacpp(python: Path, job: dict, tmp_path: Path, timeout: int = 600) -> dict:
    """One llama.cpp job (llamacpp_worker.py) in the llama.cpp environment; its JSON result."""
    job_file, result_file = tmp_path / "llamacpp-job.json", tmp_path / "llamacpp-result.json"
    job_file.write_text(json.dumps(job))
    result_file.unlink(missing_ok=True)
    proc = subprocess.run(
        [str(python), str(WORKER), str(job_file), str(result_file)],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0 and result_file.is_file(), f"llama.cpp worker failed:\n{proc.stderr[-3000:]}"
    return json.loads(result_file.read_text())
