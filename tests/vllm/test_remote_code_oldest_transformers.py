"""The remote-code set on the oldest transformers it supports (5.16.1, in the vLLM environment), every family.

kha-hf's own tests run transformers 5.24; this runs the same checkpoints' code files in the vLLM environment, which
scripts/install.sh pins to `configuration_kha.MIN_TRANSFORMERS`, without kha_hf, through `trust_remote_code`.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from kha_hf import KHAForCausalLM
from kha_hf.modeling.configuration_kha import MIN_TRANSFORMERS
from tests.helpers import ALL_FAMILIES, MLA_FAMILIES, randomize_knocks, tiny_base_model
from tests.vllm.conftest import run_worker

IDS = [[3, 9, 27, 81, 5, 15, 45, 7, 21]]
# transformers releases change kernels of some families' non-attention parts (Qwen3-Next's linear attention moved
# between 5.16 and 5.24: 1.8e-7 here); the attention and knocks path is exact on every other family
ATOL = {"qwen3_next": 1e-5}


def test_install_script_pins_the_oldest_supported_transformers():
    script = (Path(__file__).resolve().parents[2] / "scripts" / "install.sh").read_text()
    assert f'REMOTE_CODE_MIN_TRANSFORMERS="transformers=={MIN_TRANSFORMERS}"' in script


def test_every_family_runs_as_remote_code_on_the_oldest_transformers(vllm_env, tmp_path):
    expected = {}
    for family in ALL_FAMILIES:
        kha = KHAForCausalLM.from_base(
            tiny_base_model(family, "eager"), knock="linear_qkv" if family in MLA_FAMILIES else "mlp_v_linear_qk"
        )
        randomize_knocks(kha)
        kha.save_pretrained(tmp_path / family)
        with torch.no_grad():
            expected[family] = kha(torch.tensor(IDS)).logits
    torch.save(expected, tmp_path / "expected.pt")
    job = {"mode": "remote_code", "expected": str(tmp_path / "expected.pt"), "ids": IDS, "root": str(tmp_path)}
    (tmp_path / "worker").mkdir()
    result = run_worker(vllm_env, job, tmp_path / "worker")
    assert re.fullmatch(re.escape(MIN_TRANSFORMERS), result.pop("transformers"))
    for family in ALL_FAMILIES:
        assert result[family] <= ATOL.get(family, 0.0), (family, result[family])
