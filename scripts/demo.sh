#!/usr/bin/env bash
# The main job, end to end, on an embedded default: synthesize a K3-shaped checkpoint and look
# inside it, then do the same for the full-size K3 inventory (headers only, sparse files).
# Later stages (fetch from a loopback hub, verify, reshard, preflight) join as they land.
#
# Usage: scripts/demo.sh [WORK_DIR]        (default: work/demo; re-runs reuse what is there)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
ensure_venv ""

WORK="$(mkdir -p "${1:-work/demo}" && cd "${1:-work/demo}" && pwd)"
SMALL="$WORK/k3-small"
FULL="$WORK/k3-full"
step() { printf '\n== %s\n' "$*"; }

synth_once() {  # synth_once DIR ARGS...: skip when a previous run completed it
  local dir="$1"; shift
  if [ -f "$dir.done" ]; then
    echo "reusing $dir (delete $dir.done to rebuild)"
  else
    k3ckpt synth "$dir" --force "$@"
    touch "$dir.done"
  fi
}

step "1. synthesize k3-small (~1 GB, MXFP4 experts quantized with the OCP rule)"
synth_once "$SMALL" --preset k3-small

step "2. inspect k3-small"
k3ckpt inspect "$SMALL" --layers

step "3. synthesize the full K3 inventory, headers only (1.56 TB apparent, sparse)"
synth_once "$FULL" --preset k3-full --headers-only

step "4. inspect the full inventory (headers of 96 shards, ~497k tensors)"
start=$(date +%s.%N)
k3ckpt inspect "$FULL"
end=$(date +%s.%N)
printf 'inspected in %.1f s\n' "$(echo "$end - $start" | bc 2>/dev/null || python3 -c "print($end - $start)")"

step "done"
cat <<EOT
k3-small checkpoint     $SMALL ($(du -sh "$SMALL" | cut -f1) on disk)
k3-full (headers only)  $FULL ($(du -sh "$FULL" | cut -f1) on disk, $(du -sh --apparent-size "$FULL" | cut -f1) apparent)
machine-readable report: k3ckpt inspect $SMALL --json
EOT
