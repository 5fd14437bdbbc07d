#!/usr/bin/env bash
# The one-command GPU check (rlnode/tools/gpu_check.py says what it runs):
#   scripts/gpu_check.sh [--out FILE] [--device cpu] [--only STEP,...] [--plan]
# Works from this checkout with whatever Python has torch + vLLM:
#   * .venv/bin/python when `make EXTRA=gpu setup` made one;
#   * else python3 with vLLM on PYTHONPATH, e.g. the lent GPU machine's
#     bundle (docs/design/gpu-h100.md: torch 2.11 + CUDA 13 in the
#     image, vLLM 0.26.0 unpacked under /tmp/site, no network).
# rlnode is then not an installed distribution, so vLLM would not find the
# engine guard plugin (an entry point; rlnode refuses to start engines
# without it): this writes the distribution metadata that registers it
# into a folder on PYTHONPATH, with no network and no pip.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
if ! "$py" -c "import importlib.metadata as m; m.distribution('rlnode')" 2>/dev/null; then
  meta="${RLNODE_GPU_CHECK_META:-$repo/runs/gpu-check/meta}"
  mkdir -p "$meta/rlnode-0.1.0.dist-info"
  printf 'Metadata-Version: 2.1\nName: rlnode\nVersion: 0.1.0\n' > "$meta/rlnode-0.1.0.dist-info/METADATA"
  # The same entry point as pyproject.toml's [project.entry-points."vllm.general_plugins"].
  printf '[vllm.general_plugins]\nrlnode_engine_guard = rlnode.actor.engine_guard:install\n' \
    > "$meta/rlnode-0.1.0.dist-info/entry_points.txt"
  export PYTHONPATH="$PYTHONPATH:$meta"
  echo "gpu-check: rlnode is not installed here; registered its vLLM plugin from $meta" >&2
fi
exec "$py" -m rlnode.tools.gpu_check "$@"
