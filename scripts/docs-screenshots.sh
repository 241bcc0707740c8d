#!/usr/bin/env bash
# Build the docs site and save screenshots of its home page and one guide, as a browser shows them: the site is
# served on 127.0.0.1 by Python's http.server and opened by headless Chromium (Debian's package: apt install
# chromium). The PNGs go to a folder outside the repository: $1, default ${TMPDIR:-/tmp}/kha-docs-screenshots.
# Look at them before a change to the site is done.
#
#   bash scripts/docs-screenshots.sh [OUT_DIR]
#
# Needs the docs tools (bash scripts/install.sh docs); KHA_PYTHON picks the Python that has them (default:
# .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${TMPDIR:-/tmp}/kha-docs-screenshots}"
case "$(realpath -m "$out")/" in "$(pwd -P)"/*) echo "OUT_DIR must lie outside the repository: $out" >&2; exit 2 ;; esac
py="${KHA_PYTHON:-.venv/bin/python}"
[ -x "$py" ] || py=python3
browser="$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)"
[ -n "$browser" ] || { echo "no Chromium found: apt install chromium (Debian) or set PATH" >&2; exit 2; }

site="$(mktemp -d)"
profile="$(mktemp -d)"
server=""
cleanup() {
  [ -n "$server" ] && kill "$server" 2>/dev/null || true
  rm -rf "$site" "$profile"
}
trap cleanup EXIT

echo "building the site (mkdocs build --strict)"
NO_MKDOCS_2_WARNING=1 "$py" -m mkdocs build --strict --quiet --site-dir "$site"

port="$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
"$py" -m http.server "$port" --bind 127.0.0.1 --directory "$site" >/dev/null 2>&1 &
server=$!
for _ in $(seq 50); do
  "$py" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/')" 2>/dev/null && break
  sleep 0.2
done

mkdir -p "$out"
shoot() {  # NAME PATH WIDTH HEIGHT
  "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --user-data-dir="$profile" \
    --window-size="$3,$4" --virtual-time-budget=4000 --screenshot="$out/$1.png" "http://127.0.0.1:$port/$2" \
    >/dev/null 2>&1
  echo "$out/$1.png"
}
shoot home "" 1600 1400
shoot guide-convert "guides/convert/" 1600 1400
shoot reference-cli "reference/cli/" 1600 1400
shoot reference-api "reference/api/" 1600 2400
shoot home-narrow "" 420 1000
