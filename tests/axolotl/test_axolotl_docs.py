"""docs/guides/axolotl.md runs as written in Axolotl's environment: its first Python block (a tiny model and data
set), its full YAML as `knock.yml`, its `axolotl train` and `axolotl merge-lora` commands (Axolotl's own console script,
as a user types them), and the Python block that loads the adapter."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
PAGE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "axolotl.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _blocks(language: str) -> list[str]:
    return [code for lang, code in FENCE.findall(PAGE.read_text()) if lang == language]


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(cwd / "hf_home"),
        # the environment activated, as the page says (`axolotl train` starts `accelerate launch` from PATH)
        "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
    }
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)


def test_the_axolotl_guide_runs_as_written(tmp_path):
    python = _blocks("python")
    made = _run([sys.executable, "-c", python[0]], tmp_path)
    assert made.returncode == 0, made.stderr[-3000:]
    runnable = [block for block in _blocks("yaml") if "datasets:" in block and "adapter: knock" in block]
    (tmp_path / "knock.yml").write_text(runnable[0])  # the page's full YAML, as written
    commands = [line for line in _blocks("bash")[1].splitlines() if "axolotl " in line]
    assert [shlex.split(line.split("#")[0])[1:3] for line in commands] == [
        ["axolotl", "train"],
        ["axolotl", "merge-lora"],
    ]
    bin_dir = Path(sys.executable).parent
    for line in commands:
        words = shlex.split(line.split("#")[0])
        env_assignment, argv = words[0], words[1:]
        assert env_assignment == "AXOLOTL_DO_NOT_TRACK=1"
        done = _run([str(bin_dir / argv[0]), *argv[1:]], tmp_path)
        assert done.returncode == 0, f"{line}\n{done.stderr[-4000:]}"
    assert (tmp_path / "knock-out" / "adapter_model.safetensors").exists()
    loaded = _run([sys.executable, "-c", python[1] + "\nprint('LOADED', type(model).__name__)"], tmp_path)
    assert loaded.returncode == 0 and "LOADED PeftModelForCausalLM" in loaded.stdout, loaded.stderr[-3000:]

    # what the commands wrote: the trained adapter, and a stock Llama with the linear knocks folded in
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import kha_hf  # noqa: F401

    ids = torch.tensor([[5, 17, 42, 9, 77, 3]])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny-llama")(ids).logits
        adapted = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tmp_path / "tiny-llama"), tmp_path / "knock-out"
        )(ids).logits
        merged_model = AutoModelForCausalLM.from_pretrained(tmp_path / "knock-out" / "merged")
        merged = merged_model(ids).logits
    assert type(merged_model).__name__ == "LlamaForCausalLM"
    assert (adapted - base).abs().max() > 1e-4, "the trained knocks changed nothing"
    assert (merged - adapted).abs().max() < 1e-4, (merged - adapted).abs().max()
