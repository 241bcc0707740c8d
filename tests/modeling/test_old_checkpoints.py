"""Checkpoints written by kha-hf 0.1.0 (before the package layout moved) still load, with exact logits.

The fixture is a tiny Llama KHA model (q/k/v biases, mlp_v_linear_qk knocks moved off the identity) saved by
0.1.0's `save_pretrained`, with its remote-code files, plus the logits it produced: an archive, so its code files
stay byte-for-byte what that release wrote.
"""

import tarfile
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import kha_hf
from tests.helpers import run_python

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "kha-0.1.0-llama.tar.gz"


@pytest.fixture
def old_checkpoint(tmp_path) -> tuple[Path, dict]:
    with tarfile.open(FIXTURE) as archive:
        archive.extractall(tmp_path, filter="data")
    return tmp_path / "kha-0.1.0-llama", load_file(tmp_path / "kha-0.1.0-llama.expected.safetensors")


def test_old_checkpoint_loads_with_the_installed_package(old_checkpoint):
    folder, expected = old_checkpoint
    for model in (
        kha_hf.KHAForCausalLM.from_pretrained(folder, attn_implementation="eager"),
        AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager"),
    ):
        assert isinstance(model, kha_hf.KHAForCausalLM) and model.config.knock_q == "linear"
        with torch.no_grad():
            assert torch.equal(model(expected["input_ids"]).logits, expected["logits"])


def test_old_checkpoint_loads_as_remote_code_without_kha_hf(old_checkpoint, tmp_path):
    folder, _ = old_checkpoint
    script = textwrap.dedent(
        f"""
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(
            {str(folder)!r}, trust_remote_code=True, attn_implementation="eager"
        )
        expected = load_file({str(folder.parent / "kha-0.1.0-llama.expected.safetensors")!r})
        with torch.no_grad():
            assert torch.equal(model(expected["input_ids"]).logits, expected["logits"])
        print("OLD_REMOTE_OK")
        """
    )
    result = run_python(script, tmp_path)
    assert "OLD_REMOTE_OK" in result.stdout, result.stdout + result.stderr


def test_resaving_an_old_checkpoint_keeps_the_remote_code_file_names(old_checkpoint, tmp_path):
    folder, expected = old_checkpoint
    kha_hf.KHAForCausalLM.from_pretrained(folder).save_pretrained(tmp_path / "resaved")
    names = {p.name for p in (tmp_path / "resaved").iterdir()}
    assert {"configuration_kha.py", "modeling_kha.py", "knocks.py"} <= names
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "resaved", attn_implementation="eager")
    with torch.no_grad():
        assert torch.equal(model(expected["input_ids"]).logits, expected["logits"])
