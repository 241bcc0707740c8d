"""The vLLM environment: `.venv-vllm` (scripts/install.sh vllm) or $KHA_VLLM_PYTHON.

vLLM lives in its own environment (it pins an older transformers than kha-hf), so these tests drive it in
subprocesses: `tests/vllm/vllm_worker.py` for the Python API, `vllm serve` for the server. Without that environment
the tests skip, naming the command that enables them; with KHA_REQUIRE_VLLM=1 (CI) they fail instead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import side_environment

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("vllm_worker.py")
WITHOUT_PLUGIN = "none"  # a VLLM_PLUGINS allow-list that names no installed plugin
# The tests read vLLM's INFO lines. trl 1.16 sets VLLM_LOGGING_LEVEL=ERROR in os.environ when it is imported
# (trl/_compat.py, _patch_vllm_logging), which a subprocess started after any TRL test in the same worker inherits.
VLLM_LOG_INFO = {"VLLM_LOGGING_LEVEL": "INFO"}


@pytest.fixture(scope="session")
def vllm_env() -> Path:
    """The vLLM environment's python, after checking that vLLM imports there."""
    return side_environment("vLLM", ".venv-vllm", "vllm", "KHA_VLLM_PYTHON", "KHA_REQUIRE_VLLM", "vllm")


def run_worker(
    python: Path, job: dict, tmp_path: Path, timeout: int = 1800, env: dict | None = None, engine_process: bool = False
) -> dict:
    """One vLLM job in the vLLM environment (offline, its own HF_HOME, ENV added); its JSON result, with the job's
    output (vLLM's log: stdout and stderr) under "_log".

    The engine core runs inside the worker process (VLLM_ENABLE_V1_MULTIPROCESSING=0) unless ENGINE_PROCESS: the same
    model runner and executor compute the same tokens and log-probabilities (bit-equal, measured 2026-12-03 on three
    KHA checkpoints), and a model loads in about 13 s instead of 49 s on this 2-core CPU (spawning the engine process,
    waiting for its handshake and killing it at shutdown). vLLM's default, an engine process per model, as users run
    it, is what `vllm serve` starts in test_vllm_server.py and test_vllm_plugin.py, and tensor parallelism's test."""
    (tmp_path / "job.json").write_text(json.dumps(job))
    extra = env or {}
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf_home"),
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache: tiny models, short prompts
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if engine_process else "0",
        # vLLM runs only the general plugins named here: by default not kha-hf-vllm (which scripts/install.sh vllm
        # installs), so the remote-code route is tested as a user without the plugin meets it; `with_plugin` names it
        "VLLM_PLUGINS": WITHOUT_PLUGIN,
        **VLLM_LOG_INFO,
    }
    env.pop("HF_MODULES_CACHE", None)
    env.update(extra)
    proc = subprocess.run(
        [str(python), str(WORKER), str(tmp_path / "job.json"), str(tmp_path / "result.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=tmp_path,
    )
    log = proc.stdout + proc.stderr
    (tmp_path / "worker.log").write_text(log)  # for a reader after the run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {**json.loads((tmp_path / "result.json").read_text()), "_log": log}


@pytest.fixture(scope="session")
def smollm2_plain(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as a plain Llama safetensors checkpoint (its GGUF dequantised once per session)."""
    from kha_hf.common.assets import smollm2_gguf
    from kha_hf.conversion.source import dequantize_gguf

    folder = tmp_path_factory.mktemp("smollm2") / "plain"
    dequantize_gguf(smollm2_gguf(), folder)
    return folder


@pytest.fixture(scope="session")
def vllm_plugin(vllm_env, tmp_path_factory) -> Path:
    """The kha-hf-vllm plugin built from this checkout (plugins/vllm) and installed with vLLM's pip into a folder of
    its own: a worker that puts it first on PYTHONPATH runs the code under test, not whatever copy `scripts/install.sh
    vllm` installed into the environment earlier (importlib.metadata keeps the first distribution of a name)."""
    root = tmp_path_factory.mktemp("kha-hf-vllm")
    source = root / "checkout"  # built from a copy: two test workers building in the checkout would share build/
    ignore = shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
    shutil.copytree(ROOT / "plugins" / "vllm", source / "plugins" / "vllm", ignore=ignore)
    for sub in ("modeling", "vllm_plugin", "common"):
        shutil.copytree(ROOT / "kha_hf" / sub, source / "kha_hf" / sub, ignore=ignore)
    target = root / "site"
    proc = subprocess.run(
        [
            str(vllm_env),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(source / "plugins" / "vllm"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return target


def with_plugin(plugin: Path) -> dict:
    """The environment variables that put the plugin built by `vllm_plugin` in front of vLLM's own packages."""
    path = os.pathsep.join(filter(None, [str(plugin), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "VLLM_PLUGINS": "kha", **VLLM_LOG_INFO}
