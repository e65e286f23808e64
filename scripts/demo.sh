#!/usr/bin/env bash
# The main job, end to end, on an embedded default: a synthetic K3-shaped checkpoint published
# on a loopback hub (127.0.0.1 only), pinned, fetched, verified and inspected on a "node"; then
# resharded into the node directories vLLM loads; then the full-size K3 inventory (headers only,
# sparse files) inspected, planned and re-verified; finally preflight on a node directory, as a
# node's init container would run it before the engine boots.
#
# Usage: scripts/demo.sh [WORK_DIR]        (default: work/demo; re-runs reuse what is there)
#        scripts/demo.sh --serve [WORK_DIR]  hub to first token with a real vllm serve (vLLM CPU):
#          scripts/serve_demo.py, k3ckpt's route and the naive one side by side (default WORK_DIR
#          work/serve-demo); creates the engine env first when missing (scripts/engine_env.sh,
#          ~2 minutes and 3.4 GB once), then ~4 minutes
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
ensure_venv ""
if [ "${1:-}" = "--serve" ]; then
  bash scripts/engine_env.sh >/dev/null  # creates or reuses the engine env; a failed install stops here
  exec .venv/bin/python scripts/serve_demo.py --work "${2:-work/serve-demo}"
fi
# vLLM's pinned wheel, read (never installed) by the last step to check the node directories with
# vLLM's own functions; a cache outside the repository, instant once there.
bash scripts/engines.sh .venv/bin/python

WORK="$(mkdir -p "${1:-work/demo}" && cd "${1:-work/demo}" && pwd)"
HUBDIR="$WORK/hub/Kimi-K3"          # what the (loopback) hub serves
NODE="$WORK/node/Kimi-K3"           # what a node downloads
NODE1="$WORK/node1/Kimi-K3-tp2-dp4"  # what a second node downloads: its node directory, straight from the hub
FULL="$WORK/k3-full"
NODES="$WORK/node/Kimi-K3-tp2-dp4"   # node directories for vLLM TP2 x DP4 (EP8) on two 4-GPU nodes
MANIFEST="$WORK/kimi-k3.manifest.json"
TENSORS="$WORK/kimi-k3.tensors.json"

# Re-runs reuse WORK, but only what this k3ckpt would write itself: when the package changed
# since the last run (another version, another synthetic rule), the demo's own outputs - the
# paths above and nothing else in WORK - are rebuilt rather than trusted.
STAMP="$(python -c 'import hashlib, pathlib, k3ckpt, k3ckpt.testing.synth as s; print(k3ckpt.__version__, hashlib.sha256(b"".join(p.read_bytes() for p in sorted(pathlib.Path(s.__file__).parent.glob("*.py")))).hexdigest())')"
if [ "$(cat "$WORK/.demo-stamp" 2>/dev/null)" != "$STAMP" ]; then
  [ ! -e "$HUBDIR.done" ] || echo "k3ckpt changed since the last demo run: rebuilding the demo's outputs in $WORK"
  rm -rf "$WORK/hub" "$HUBDIR.done" "$WORK/node" "$WORK/node1" "$FULL" "$FULL.done" "$WORK/hub-cache" "$WORK/cache" \
    "$WORK/hf-home" "$MANIFEST" "$MANIFEST.sig" "$TENSORS"
fi
printf '%s\n' "$STAMP" > "$WORK/.demo-stamp"
REPO="moonshotai/Kimi-K3"
export K3CKPT_CACHE_DIR="$WORK/cache" HF_HUB_DISABLE_XET=1 HF_HUB_DISABLE_TELEMETRY=1 HF_HOME="$WORK/hf-home"
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

step "1. synthesize k3-small (~1 GB; MXFP4 experts quantized as compressed-tensors does) as the hub's copy"
mkdir -p "$(dirname "$HUBDIR")"
synth_once "$HUBDIR" --preset k3-small

step "2. serve it on a loopback hub (Hugging Face + ModelScope APIs, 127.0.0.1 only)"
HUB_LOG="$WORK/hub.log"
python -m k3ckpt.testing.hub "$HUBDIR" --repo "$REPO" --port 0 --cache-dir "$WORK/hub-cache" > "$HUB_LOG" 2>&1 &
HUB_PID=$!
trap 'kill $HUB_PID 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do grep -q '^Serving on' "$HUB_LOG" 2>/dev/null && break; sleep 0.1; done
HF_ENDPOINT="$(sed -n 's/^Serving on //p' "$HUB_LOG")"
[ -n "$HF_ENDPOINT" ] || { cat "$HUB_LOG" >&2; echo "demo: the loopback hub did not start" >&2; exit 2; }
export HF_ENDPOINT MODELSCOPE_ENDPOINT="$HF_ENDPOINT"
echo "hub at $HF_ENDPOINT serving $REPO"

step "3. pin a manifest from hub metadata alone (sizes, sha256, shard headers by Range requests); sign it"
k3ckpt manifest pull --source hf --repo "$REPO" -o "$MANIFEST" --json
# the release operator's key; the fleet gets only the .pub
[ -f "$WORK/release.key" ] || k3ckpt manifest keygen "$WORK/release.key"
k3ckpt manifest sign "$MANIFEST" --key "$WORK/release.key"

step "4. fetch it to the node: parallel ranged chunks, resumable, every file's sha256 checked"
k3ckpt fetch "$REPO" --local-dir "$NODE" --chunk-size 16MiB

step "5. verify the node's copy against the pinned, signed manifest (signature, structure, every sha256)"
k3ckpt verify "$NODE" --manifest "$MANIFEST" --signature "$MANIFEST.sig" --pubkey "$WORK/release.key.pub"

step "6. verify again against the hub's own listing, then --quick from the stat cache"
k3ckpt verify "$NODE" --against hf --repo "$REPO"
k3ckpt verify "$NODE" --manifest "$MANIFEST" --quick

step "7. inspect the node's copy"
k3ckpt inspect "$NODE" --layers

step "8. plan and reshard the node's copy into node directories: vLLM TP2 x DP4 = EP8 on two 4-GPU nodes"
k3ckpt plan "$NODE" --tp 2 --dp 4 --gpus-per-node 4
k3ckpt reshard "$NODE" -o "$NODES" --tp 2 --dp 4 --gpus-per-node 4

step "9. a second node fetches only its share, as its node directory: node 1 (ranks 4-7), from ModelScope"
# per-tensor digests pinned before the download (the hub's sha256 covers whole files only): one
# streamed read of the hub's files, each checked against the hub's sha256 in the same pass
[ -f "$TENSORS" ] || k3ckpt manifest pull --source hf --repo "$REPO" --tensor-hashes -o "$TENSORS"
k3ckpt fetch "$REPO" --source modelscope --local-dir "$NODE1" --tp 2 --dp 4 --node 1 --gpus-per-node 4 \
  --manifest "$TENSORS"
# the node proves its share later too: every tensor it holds, and that its ranks' experts are all there
k3ckpt verify "$NODE1" --manifest "$TENSORS"
# the same directory reshard wrote for node 1 in step 8, byte for byte (fetch also keeps its source record)
diff -r --exclude=.cache "$NODES/node-00001" "$NODE1" && echo "identical: $NODES/node-00001 and $NODE1"
k3ckpt preflight "$NODE1" --engine vllm --tp 2 --dp 4 --node 1 --gpus-per-node 4 --no-env

step "10. the full K3 inventory, headers only (96 shards, ~497k tensors, 1.56 TB apparent, sparse)"
synth_once "$FULL" --preset k3-full --headers-only
k3ckpt inspect "$FULL"
k3ckpt verify "$FULL" --quick >/dev/null || true   # first run: parses every header, fills the cache
k3ckpt verify "$FULL" --quick                       # unchanged: seconds
k3ckpt plan "$FULL" --ep 8 --tp 8 --gpus-per-node 8

step "11. preflight node 0's directory: the launcher's topology, its experts, read speed"
# the launcher's variables, as torchrun would set them for this node's first worker
RANK=0 WORLD_SIZE=8 LOCAL_RANK=0 LOCAL_WORLD_SIZE=4 GROUP_RANK=0 \
  k3ckpt preflight "$NODES/node-00000" --engine vllm --tp 2 --dp 4 --node 0 --gpus-per-node 4 --full --io-test 3

step "12. vLLM's own functions (from its pinned wheel) on both nodes' directories"
if [ -n "$(ls "${K3CKPT_ENGINE_CACHE:-$HOME/.cache/k3ckpt/engines}"/vllm-0.33.0-*.whl 2>/dev/null)" ]; then
  python tests/engines.py check "$NODE" "$NODES/node-00000" 2 4 4 0
  python tests/engines.py check "$NODE" "$NODE1" 2 4 4 1
else
  echo "skipped: vLLM's wheel could not be downloaded (scripts/engines.sh)"
fi

step "done"
cat <<EOT
hub's copy              $HUBDIR ($(du -sh "$HUBDIR" | cut -f1))
node's copy             $NODE
node 1's share          $NODE1 ($(du -sh "$NODE1" | cut -f1))
node directories        $NODES
pinned manifest         $MANIFEST
k3-full (headers only)  $FULL ($(du -shL "$FULL" | cut -f1) on disk, $(du -shL --apparent-size "$FULL" | cut -f1) apparent)
stat cache              $K3CKPT_CACHE_DIR
EOT
