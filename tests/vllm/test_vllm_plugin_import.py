"""kha-hf's vLLM plugin costs nothing where vLLM is not: in kha-hf's own environment (no vLLM), without vLLM's.

kha-hf declares the plugin as an entry point (setup.cfg: `vllm.general_plugins`, kha = kha_hf.vllm_plugin:register);
only vLLM loads it. Importing `kha_hf.vllm_plugin` imports no vLLM and nothing beyond what `import kha_hf` imports
(the package's `__init__`, which registers KHA with transformers and peft, runs first as for any subpackage); the
module itself, without that `__init__`, imports neither torch nor transformers nor vLLM: `register()` does.
"""

from __future__ import annotations

import configparser
import json
import subprocess
import sys
from pathlib import Path

import kha_hf

ROOT = Path(__file__).resolve().parents[2]

THROUGH_THE_PACKAGE = """
import json, sys
import kha_hf
before = set(sys.modules)
import kha_hf.vllm_plugin
print(json.dumps({"added": sorted(set(sys.modules) - before), "vllm": "vllm" in sys.modules}))
"""

ON_ITS_OWN = """
import json, sys, types
# kha_hf as a bare package (its __init__ not run): what kha_hf/vllm_plugin/__init__.py itself imports
package = types.ModuleType("kha_hf")
package.__path__ = [sys.argv[1]]
sys.modules["kha_hf"] = package
import kha_hf.vllm_plugin
print(json.dumps(sorted(name for name in ("torch", "transformers", "vllm", "peft") if name in sys.modules)))
"""


def run(script: str, tmp_path: Path, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_importing_the_plugin_imports_no_vllm_and_nothing_beyond_kha_hf(tmp_path):
    out = json.loads(run(THROUGH_THE_PACKAGE, tmp_path))
    assert out == {"added": ["kha_hf.vllm_plugin"], "vllm": False}, out


def test_the_plugin_module_on_its_own_imports_neither_torch_nor_vllm(tmp_path):
    assert json.loads(run(ON_ITS_OWN, tmp_path, str(Path(kha_hf.__file__).parent))) == []


def test_setup_cfg_declares_the_entry_point_vllm_runs():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    plugins = config["options.entry_points"]["vllm.general_plugins"].split()
    assert plugins == ["kha", "=", "kha_hf.vllm_plugin:register"], plugins
    assert "kha = kha_hf_entry:main" in config["options.entry_points"]["console_scripts"]
