#!/usr/bin/env bash
# kha-hf inside Axolotl: tests/axolotl (the plugin kha_hf.integrations.axolotl.KHAPlugin driven through Axolotl's own
# API on tiny models, on the CPU) and the knock-adapter tests of tests/peft (peft 0.20, Axolotl's pin: the file
# format and load checks of kha_hf/peft/compat.py), run by kha-hf as installed in Axolotl's environment
# (`bash scripts/install.sh axolotl`: axolotl 0.19.0, transformers 5.16.1, peft 0.20.0, trl 1.9.0, accelerate 1.13.0).
# One process, one thread per op (OMP_NUM_THREADS=1): the float32 comparisons are exact. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${KHA_AXOLOTL_VENV:-.venv-axolotl}/bin/python"
[ -x "$py" ] || { echo "no Axolotl environment: run bash scripts/install.sh axolotl first" >&2; exit 2; }
"$py" - <<'PY'
from importlib import metadata
names = ("axolotl", "transformers", "peft", "trl", "accelerate", "torch", "kha-hf")
print("Axolotl's environment: " + ", ".join(f"{name} {metadata.version(name)}" for name in names))
PY
# tests/peft/test_eval_adapter.py runs kha eval, which needs lm-eval 0.4.13 (Axolotl pins 0.4.11); peft's own test
# suite (test_peft_upstream.py) runs at the newest end
export KHA_REQUIRE_AXOLOTL=1 OMP_NUM_THREADS=1 AXOLOTL_DO_NOT_TRACK=1 KHA_SKIP_UPSTREAM_TESTS=1
exec "$py" -m pytest -q -p no:cacheprovider tests/axolotl tests/peft \
  --ignore=tests/peft/test_eval_adapter.py --ignore=tests/peft/test_peft_upstream.py "$@"
