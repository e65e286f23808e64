#!/usr/bin/env bash
# Download the pinned inference-engine wheels that tests/test_engine_conformance.py reads: the
# engines' own code judges the node directories k3ckpt writes (docs/engines.md).
#
# The wheels go to a cache outside the repository, ${K3CKPT_ENGINE_CACHE:-~/.cache/k3ckpt/engines},
# without their dependencies (they pull torch, CUDA libraries, ...): the tests open the wheel as a
# zip file and load a few pure-Python functions from it; nothing is installed into .venv.
# A wheel already in the cache is not downloaded again (this is the cheap path CI takes). A failed
# download is reported and never fails the caller: the conformance tests then skip, saying why.
# Usage: scripts/engines.sh [PYTHON]   (PYTHON runs pip; default .venv/bin/python, else python3)
set -uo pipefail
cd "$(dirname "$0")/.."

# Keep in step with tests/engines.py (ENGINES): the versions the conformance tests were written against.
PINNED=("vllm==0.33.0" "sglang==0.5.23")
cache="${K3CKPT_ENGINE_CACHE:-$HOME/.cache/k3ckpt/engines}"
py="${1:-}"
[ -n "$py" ] || { [ -x .venv/bin/python ] && py=.venv/bin/python || py=python3; }

mkdir -p "$cache" 2>/dev/null || { echo "k3ckpt: engine cache $cache cannot be created; engine conformance tests will skip" >&2; exit 0; }
for spec in "${PINNED[@]}"; do
  name="${spec%%==*}" version="${spec##*==}"
  if compgen -G "$cache/$name-$version-*.whl" >/dev/null; then
    continue
  fi
  echo "== downloading $spec (wheel only, no dependencies) into $cache" >&2
  # The second try asks for the cp311 Linux wheel explicitly, for when this Python is another
  # version (sglang publishes cp311 wheels only); the tests read its source files, never its
  # compiled parts, so any Python can use it.
  if ! timeout 600 "$py" -m pip download -q --no-deps "$spec" -d "$cache" >"$cache/$name-download.log" 2>&1 \
      && ! timeout 600 "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
        --platform manylinux_2_34_x86_64 "$spec" -d "$cache" >>"$cache/$name-download.log" 2>&1; then
    echo "k3ckpt: could not download $spec (see $cache/$name-download.log); its conformance tests will skip" >&2
  fi
done
exit 0
