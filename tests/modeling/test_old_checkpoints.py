"""Checkpoints written by kha-hf 0.1.0 (before the package layout moved) still load unchanged.

The fixture is a tiny Llama KHA model (q/k/v biases, mlp_v_linear_qk knocks moved off the identity) saved by
0.1.0's `save_pretrained`, with its remote-code files, plus the logits it produced: an archive, so its code files
stay byte-for-byte what that release wrote.

What is guaranteed, and so compared exactly: every tensor loads bit for bit, and the same weights through the same
code path in one process give equal logits (installed class vs Auto class; the checkpoint vs its re-save). What is
not: the logits stored in the archive were computed on another CPU, whose float32 kernels (SIMD width, BLAS
blocking) sum in another order. Those are compared within LOGIT_ATOL, about 100 float32 ulps at this model's logit
scale (|logit| < 1): reordering a sum of n terms changes it by at most ~n·eps·Σ|terms|, which for these 64-wide,
2-layer products is ~1e-6; a real change in the model (a knock dropped, a bias moved) changes logits by > 1e-2.
"""

import tarfile
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import kha_hf
from tests.helpers import assert_close, run_python

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "kha-0.1.0-llama.tar.gz"
LOGIT_ATOL = 1e-5  # stored logits vs this CPU's (see the module docstring); observed: 6e-8 on AMD EPYC (AVX2)


@pytest.fixture
def old_checkpoint(tmp_path) -> tuple[Path, dict]:
    with tarfile.open(FIXTURE) as archive:
        archive.extractall(tmp_path, filter="data")
    return tmp_path / "kha-0.1.0-llama", load_file(tmp_path / "kha-0.1.0-llama.expected.safetensors")


def _stored_weights(folder: Path) -> dict[str, torch.Tensor]:
    weights = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(file))
    return weights


def test_old_checkpoint_loads_with_the_installed_package(old_checkpoint):
    folder, expected = old_checkpoint
    stored = _stored_weights(folder)
    logits = []
    for model in (
        kha_hf.KHAForCausalLM.from_pretrained(folder, attn_implementation="eager"),
        AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager"),
    ):
        assert isinstance(model, kha_hf.KHAForCausalLM) and model.config.knock_q == "linear"
        state = model.state_dict()
        for name, tensor in stored.items():
            assert torch.equal(state[name], tensor), f"{name} did not load bit for bit"
        with torch.no_grad():
            logits.append(model(expected["input_ids"]).logits)
    assert torch.equal(logits[0], logits[1]), "the same weights through the same code gave different logits"
    assert_close(logits[0], expected["logits"], atol=LOGIT_ATOL, what="logits vs the archive's (another CPU)")


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
            diff = (model(expected["input_ids"]).logits - expected["logits"]).abs().max().item()
        assert diff <= {LOGIT_ATOL}, diff  # the archive's logits come from another CPU: see the module docstring
        print("OLD_REMOTE_OK")
        """
    )
    result = run_python(script, tmp_path)
    assert "OLD_REMOTE_OK" in result.stdout, result.stdout + result.stderr


def test_resaving_an_old_checkpoint_keeps_the_remote_code_file_names(old_checkpoint, tmp_path):
    folder, expected = old_checkpoint
    original = kha_hf.KHAForCausalLM.from_pretrained(folder, attn_implementation="eager")
    original.save_pretrained(tmp_path / "resaved")
    names = {p.name for p in (tmp_path / "resaved").iterdir()}
    assert {"configuration_kha.py", "modeling_kha.py", "knocks.py"} <= names
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "resaved", attn_implementation="eager")
    with torch.no_grad():  # same process, same code path: exactly equal
        assert torch.equal(model(expected["input_ids"]).logits, original(expected["input_ids"]).logits)
