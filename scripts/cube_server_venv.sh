#!/usr/bin/env bash
# Create or refresh the cube-standard server venv (Python >= 3.12).
#
# cube-standard needs Python >= 3.12 and rlnode runs on 3.11, so the benchmark
# server lives in its own interpreter and rlnode reaches it only over HTTP
# (rlnode/cubes/protocol.py; launcher: scripts/serve_cube.py).
#
#   scripts/cube_server_venv.sh            # -> .venv-cube (prints its python)
#   CUBE_VENV=/path scripts/cube_server_venv.sh
#   CUBE_EXTRA_PACKAGES="miniwob-cube" scripts/cube_server_venv.sh
#
# Idempotent: a stamp names the exact requirements installed; when it matches
# and the packages import, nothing is done (`make test` calls this every run).
# The last line of stdout is the venv's python, for callers to use.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CUBE_VENV:-$ROOT/.venv-cube}"
CUBE_STANDARD_VERSION="${CUBE_STANDARD_VERSION:-0.1.0rc10}"
ARITHMETIC_CUBE_VERSION="${ARITHMETIC_CUBE_VERSION:-0.1.0}"
REQS="cube-standard==$CUBE_STANDARD_VERSION arithmetic-cube==$ARITHMETIC_CUBE_VERSION ${CUBE_EXTRA_PACKAGES:-}"
REQS="$(echo $REQS)"  # squeeze whitespace so the stamp compares stably
STAMP="$VENV/.rlnode-installed"

# One build at a time: the test suite's workers may all ask at once.
exec 9>"$VENV.lock"
flock 9

is_py312() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; }

find_python() {
    # The bare pyenv `python3.12` shim refuses without PYENV_VERSION, so real
    # interpreters under ~/.pyenv come first (docs/design/vllm-cpu.md).
    local c
    for c in "${CUBE_PYTHON:-}" "$HOME"/.pyenv/versions/3.12*/bin/python3.12 \
             "$HOME"/.pyenv/versions/3.13*/bin/python3.13 python3.12 python3.13; do
        [ -n "$c" ] || continue
        if is_py312 "$c"; then command -v "$c"; return 0; fi
    done
    return 1
}

if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$REQS" ] \
   && "$VENV/bin/python" -c 'import cube.server, arithmetic_cube, uvicorn' 2>/dev/null; then
    echo "$VENV/bin/python"
    exit 0
fi

if ! is_py312 "$VENV/bin/python"; then
    PY="$(find_python)" || { echo "cube_server_venv: no Python >= 3.12 found (set CUBE_PYTHON)" >&2; exit 2; }
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
fi
rm -f "$STAMP"
# shellcheck disable=SC2086  # REQS is a word list on purpose
"$VENV/bin/python" -m pip install -q --disable-pip-version-check $REQS >&2
"$VENV/bin/python" -c 'import cube.server, arithmetic_cube, uvicorn'
echo "$REQS" > "$STAMP"
echo "$VENV/bin/python"
