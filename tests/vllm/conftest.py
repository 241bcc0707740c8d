"""The vLLM environment: `.venv-vllm` (scripts/install.sh vllm) or $KHA_VLLM_PYTHON.

vLLM lives in its own environment (it pins an older transformers than kha-hf), so these tests drive it in
subprocesses: `tests/vllm/vllm_worker.py` for the Python API, `vllm serve` for the server. Without that environment
the tests skip, naming the command that enables them; with KHA_REQUIRE_VLLM=1 (CI) they fail instead.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import side_environment

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("vllm_worker.py")


@pytest.fixture(scope="session")
def vllm_env() -> Path:
    """The vLLM environment's python, after checking that vLLM imports there."""
    return side_environment("vLLM", ".venv-vllm", "vllm", "KHA_VLLM_PYTHON", "KHA_REQUIRE_VLLM", "vllm")


def run_worker(python: Path, job: dict, tmp_path: Path, timeout: int = 1800) -> dict:
    """One vLLM job in the vLLM environment (offline, its own HF_HOME); its JSON result."""
    (tmp_path / "job.json").write_text(json.dumps(job))
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf_home"),
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache: tiny models, short prompts
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    }
    env.pop("HF_MODULES_CACHE", None)
    proc = subprocess.run(
        [str(python), str(WORKER), str(tmp_path / "job.json"), str(tmp_path / "result.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((tmp_path / "result.json").read_text())


@pytest.fixture(scope="session")
def smollm2_plain(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as a plain Llama safetensors checkpoint (its GGUF dequantised once per session)."""
    from kha_hf.common.assets import smollm2_gguf
    from kha_hf.conversion.source import dequantize_gguf

    folder = tmp_path_factory.mktemp("smollm2") / "plain"
    dequantize_gguf(smollm2_gguf(), folder)
    return folder
