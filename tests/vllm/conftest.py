"""The vLLM environment: `.venv-vllm` (scripts/install.sh vllm) or $KHA_VLLM_PYTHON.

vLLM lives in its own environment (it pins transformers < 5.20 and its own torch; kha-hf goes there too, from this
checkout, editable, with its vLLM plugin), so these tests drive it in subprocesses: `tests/vllm/vllm_worker.py` for
the Python API, `vllm serve` for the server. Without that environment the tests skip, naming the command that enables
them; with KHA_REQUIRE_VLLM=1 (CI) they fail instead.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import made_once, side_environment

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
        # vLLM runs only the general plugins named here: by default not kha-hf's (which scripts/install.sh vllm
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


# `kha convert --link` for the conversions of the session's real checkpoints: their shards are hard links to it
# (nothing rewrites them in place), not 0.5 to 1.1 GB copies each (a CI run ran out of disk)
LINK = ("--link",)


@pytest.fixture(scope="session")
def smollm2_plain(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as a plain Llama safetensors checkpoint (its GGUF dequantised once per test run)."""
    from kha_hf.common.assets import smollm2_gguf
    from kha_hf.conversion.source import dequantize_gguf

    root = made_once(tmp_path_factory, "smollm2", lambda folder: dequantize_gguf(smollm2_gguf(), folder / "plain"))
    return root / "plain"


PLUGIN_CHECK = """
import importlib.metadata, json
import kha_hf
plugins = [e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "kha"]
print(json.dumps({"file": kha_hf.__file__, "plugins": plugins}))
"""


@pytest.fixture(scope="session")
def vllm_plugin(vllm_env, tmp_path_factory) -> None:
    """kha-hf's vLLM plugin as `scripts/install.sh vllm` installs it: kha-hf from this checkout, editable, in the
    vLLM environment, declaring the entry point vLLM runs (`vllm.general_plugins`: kha). Checked once per session, so
    that the tests run this checkout's code and a stale or missing install fails with the command that fixes it."""
    # -P and another folder: the checkout's own kha_hf/ must not be found as the current directory's
    cwd = tmp_path_factory.mktemp("plugin-check")
    command = [str(vllm_env), "-P", "-c", PLUGIN_CHECK]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=cwd)
    fix = "reinstall it with: bash scripts/install.sh vllm"
    if proc.returncode != 0:
        pytest.fail(f"kha_hf does not import in {vllm_env}: {proc.stderr.strip()[-2000:]}; {fix}")
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    where = Path(found["file"]).resolve().parent
    if where != ROOT / "kha_hf":
        pytest.fail(f"kha_hf in {vllm_env} is {where}, not this checkout's {ROOT / 'kha_hf'}; {fix}")
    expected = "kha_hf.vllm_plugin:register"
    if found["plugins"] != [expected]:
        pytest.fail(f"vllm.general_plugins in {vllm_env} names {found['plugins']} for kha, not [{expected!r}]; {fix}")


def with_plugin() -> dict:
    """The environment variables under which vLLM runs kha-hf's plugin (and logs the INFO lines tests read)."""
    return {"VLLM_PLUGINS": "kha", **VLLM_LOG_INFO}
