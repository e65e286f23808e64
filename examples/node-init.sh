#!/bin/sh
# node-init.sh - one node of a Kimi-K3 vLLM deployment, from an empty disk to `vllm serve`.
#
# Usage: sh node-init.sh [init|serve|print]
#
#   init   (default) fetch only this node's share of the checkpoint from the hub (rank-aware
#          `k3ckpt fetch --node`), check it with `k3ckpt preflight --engine vllm`, record the
#          serve command preflight prints in $K3_DEST.serve and print it.
#          Run it where the node starts: a Kubernetes initContainer, or `srun` once per node.
#   serve  exec the serve command init recorded (the main container, or the SLURM step after
#          init). It never downloads anything and needs no k3ckpt (the vLLM image has none); a
#          serve without a prior init stops with a one-line error.
#   print  print the serve command (`k3ckpt serve-command`) and exit.
#
# The node's index and the node count come from the launcher, never from a flag, so every node
# runs the same command line:
#   LeaderWorkerSet: LWS_WORKER_INDEX (0 = leader), LWS_GROUP_SIZE, LWS_LEADER_ADDRESS
#   SLURM (srun --ntasks-per-node=1): SLURM_NODEID, SLURM_NNODES; the leader address comes
#   from K3_LEADER_ADDRESS (the sbatch script sets it to the job's first host)
#
# Settings (environment, with defaults):
#   K3_SOURCE=hf  K3_REPO=moonshotai/Kimi-K3  K3_REVISION=main  K3_DEST=/nvme/kimi-k3
#   K3_GPUS_PER_NODE=8  K3_TP=8 (GPUs per data-parallel rank; must divide K3_GPUS_PER_NODE)
#   K3_MANIFEST (a tensor-hash manifest, `k3ckpt manifest pull REPO --tensor-hashes`: every
#     fetched tensor is checked against it, which is what proves the node's bytes)
#   K3_ALLOW_UNPROVEN=1 (hand over to the engine although the bytes are not proven - no
#     K3_MANIFEST: the node files are checked for structure and sizes only; see docs/trust.md)
#   K3_GUARD=1 (serve with --load-format k3ckpt: every rank refuses a launch this directory was
#     not written for and bytes that differ from their digests, before the first token; the
#     engine's image must then have k3ckpt installed, e.g. examples/kubernetes/Dockerfile.vllm);
#     0: without it; unset: with it when k3ckpt's vLLM plugin is installed where init runs
#   K3_DP_RPC_PORT=13345  K3_LEADER_ADDRESS (overrides LWS_LEADER_ADDRESS)
#   K3_SERVED_MODEL_NAME=$K3_REPO
#   K3_FETCH_ARGS, K3_PREFLIGHT_ARGS, K3_VLLM_ARGS: extra arguments, split on spaces
#
# Topology: world size W = nodes x GPUs per node, data parallel DP = W / TP, and vLLM's expert
# parallelism spans every rank (EP = W, expert placement linear). The node directory therefore
# holds every dense tensor whole and the experts of ranks [node*G, (node+1)*G) only.
#
# Exit codes: 0 ok, 1 preflight found a problem (its report says which; unproven bytes are one,
# unless K3_ALLOW_UNPROVEN=1), 2 could not run (a one-line `node-init.sh: error: ...` on stderr,
# or k3ckpt's own exit code; no K3_MANIFEST without K3_ALLOW_UNPROVEN=1 is refused before any
# byte is fetched).
set -eu
set -f  # the K3_*_ARGS below are split on spaces, never globbed

die() {
    printf 'node-init.sh: error: %s\n' "$*" >&2
    exit 2
}

# is_count NAME VALUE: VALUE is a non-negative decimal integer (what the launchers set).
is_count() {
    case "$2" in
        '' | *[!0-9]*) die "$1=$2 is not a non-negative integer" ;;
    esac
}

# decimal VALUE: VALUE without leading zeros, which shell arithmetic would read as octal.
decimal() {
    v=$1
    while [ "${#v}" -gt 1 ] && [ "${v#0}" != "$v" ]; do v=${v#0}; done
    echo "$v"
}

mode="${1:-init}"
case "$mode" in
    init | serve | print) ;;
    *) die "unknown mode '$mode': use init, serve or print" ;;
esac
[ "$#" -le 1 ] || die "too many arguments: configure with K3_* variables (see the header of this script)"

# --- which node is this: the launcher says ---------------------------------------------------
if [ -n "${LWS_WORKER_INDEX:-}${LWS_GROUP_SIZE:-}" ]; then
    launcher=LeaderWorkerSet
    [ -n "${LWS_WORKER_INDEX:-}" ] || die "LWS_GROUP_SIZE is set but LWS_WORKER_INDEX is not (LeaderWorkerSet >= 0.6 sets both)"
    [ -n "${LWS_GROUP_SIZE:-}" ] || die "LWS_WORKER_INDEX is set but LWS_GROUP_SIZE is not (LeaderWorkerSet >= 0.6 sets both)"
    is_count LWS_WORKER_INDEX "$LWS_WORKER_INDEX"
    is_count LWS_GROUP_SIZE "$LWS_GROUP_SIZE"
    node=$LWS_WORKER_INDEX nodes=$LWS_GROUP_SIZE
    leader="${K3_LEADER_ADDRESS:-${LWS_LEADER_ADDRESS:-}}"
elif [ -n "${SLURM_NODEID:-}${SLURM_NNODES:-}" ]; then
    launcher=SLURM
    [ -n "${SLURM_NODEID:-}" ] || die "SLURM_NNODES is set but SLURM_NODEID is not: run this script under srun, not sbatch alone"
    [ -n "${SLURM_NNODES:-}" ] || die "SLURM_NODEID is set but SLURM_NNODES is not"
    is_count SLURM_NODEID "$SLURM_NODEID"
    is_count SLURM_NNODES "$SLURM_NNODES"
    node=$SLURM_NODEID nodes=$SLURM_NNODES
    leader="${K3_LEADER_ADDRESS:-}"
else
    die "no launcher variables: set LWS_WORKER_INDEX and LWS_GROUP_SIZE (LeaderWorkerSet) or SLURM_NODEID and SLURM_NNODES (srun)"
fi

node=$(decimal "$node") nodes=$(decimal "$nodes")
[ "$nodes" -ge 1 ] || die "the launcher says $nodes nodes: at least 1 is needed"
[ "$node" -lt "$nodes" ] || die "node index $node is not below the node count $nodes"

# --- settings ----------------------------------------------------------------------------------
source_hub="${K3_SOURCE:-hf}"
repo="${K3_REPO:-moonshotai/Kimi-K3}"
revision="${K3_REVISION:-main}"
dest="${K3_DEST:-/nvme/kimi-k3}"
gpus="${K3_GPUS_PER_NODE:-8}"
tp="${K3_TP:-8}"
rpc_port="${K3_DP_RPC_PORT:-13345}"
served_name="${K3_SERVED_MODEL_NAME:-$repo}"
is_count K3_GPUS_PER_NODE "$gpus"
is_count K3_TP "$tp"
is_count K3_DP_RPC_PORT "$rpc_port"
gpus=$(decimal "$gpus") tp=$(decimal "$tp")
[ "$gpus" -ge 1 ] && [ "$tp" -ge 1 ] || die "K3_GPUS_PER_NODE=$gpus and K3_TP=$tp must be at least 1"
# One data-parallel rank must not span nodes: vLLM's multi-node data parallelism places whole
# DP ranks on a node (--data-parallel-size-local).
[ $((gpus % tp)) -eq 0 ] || die "K3_TP=$tp does not divide K3_GPUS_PER_NODE=$gpus: a tensor-parallel group must fit on one node"

world=$((nodes * gpus))
dp=$((world / tp))
dp_local=$((gpus / tp))
start_rank=$((node * dp_local))
first_rank=$((node * gpus))
last_rank=$((first_rank + gpus - 1))
if [ "$nodes" -gt 1 ] && [ -z "$leader" ]; then
    die "$nodes nodes need the leader's address: LWS_LEADER_ADDRESS (LeaderWorkerSet) or K3_LEADER_ADDRESS"
fi

# --- the serve command -------------------------------------------------------------------------
# k3ckpt writes the command line (k3ckpt.deploy.serve_command, the one home of the vLLM flags):
# expert parallelism over all DP x TP ranks, the weight filter that skips other ranks' experts
# by name before reading them, the linear placement the node directory is fetched for; across
# nodes, node 0 runs the API server and the others their DP ranks headless. `init` records
# the line preflight prints for the checked directory next to it, in $dest.serve; `serve` execs
# that record (the vLLM image has no k3ckpt), so a serve without a prior init stops here.
dest=${dest%/}
serve_file="$dest.serve"
launch_args="--tp $tp --dp $dp --placement linear --node $node --gpus-per-node $gpus --rpc-port $rpc_port"

if [ "$mode" = serve ]; then
    [ -s "$serve_file" ] || die "no serve command recorded in $serve_file: run 'node-init.sh init' on this node first"
    line=$(cat "$serve_file")
    # k3ckpt shell-quotes the line: eval restores its words exactly, expanding nothing in them
    eval "set -- $line"
    # shellcheck disable=SC2086
    set -- "$@" ${K3_VLLM_ARGS:-}
    exec "$@"
fi

command -v k3ckpt >/dev/null 2>&1 || die "k3ckpt is not on PATH (pip install k3ckpt)"
leader_args=""
if [ -n "$leader" ]; then
    leader_args="--leader-address $leader"
fi
# unset: --load-format k3ckpt when k3ckpt's vLLM plugin is installed here (SLURM, one environment);
# an init container without vLLM leaves it to K3_GUARD, since the engine runs in another image
case "${K3_GUARD:-}" in
    '') guard_args="" ;;
    1) guard_args="--guard" ;;
    0) guard_args="--no-guard" ;;
    *) die "K3_GUARD=${K3_GUARD} is not 0 or 1" ;;
esac

if [ "$mode" = print ]; then
    # shellcheck disable=SC2086
    line=$(k3ckpt serve-command "$dest" $launch_args $leader_args $guard_args --served-model-name "$served_name") || exit $?
    eval "set -- $line"
    # shellcheck disable=SC2086
    set -- "$@" ${K3_VLLM_ARGS:-}
    echo "$*"
    exit 0
fi

# --- init: this node's share, checked --------------------------------------------------------
echo "node-init: $launcher node $node of $nodes: ranks $first_rank-$last_rank of ep $world x tp $tp (dp $dp), into $dest"

# Only proven bytes are handed to the engine (docs/trust.md): fetch refuses, before any byte, to
# assemble node files it cannot check against a manifest, and preflight FAILs a share whose
# bytes nothing proved - unless K3_ALLOW_UNPROVEN=1 says to serve them anyway.
manifest_args=""
if [ -n "${K3_MANIFEST:-}" ]; then
    manifest_args="--manifest ${K3_MANIFEST}"
fi
proof_args="--require-proof"
if [ "${K3_ALLOW_UNPROVEN:-0}" = 1 ]; then
    proof_args=""
    [ -n "$manifest_args" ] || echo "node-init: K3_ALLOW_UNPROVEN=1 and no K3_MANIFEST: the node files are checked for structure and sizes only" >&2
fi
# shellcheck disable=SC2086
k3ckpt fetch "$repo" --source "$source_hub" --revision "$revision" --local-dir "$dest" \
    --node "$node" --gpus-per-node "$gpus" --tp "$tp" --dp "$dp" --placement linear \
    $manifest_args $proof_args ${K3_FETCH_ARGS:-}
# The launcher's variables are checked too: preflight reads a one-task-per-node srun
# (SLURM_PROCID = node index) and LeaderWorkerSet's LWS_WORKER_INDEX as the node's index.
# Its last line is `serve      <this node's vllm serve command>`.
rc=0
# shellcheck disable=SC2086
report=$(k3ckpt preflight "$dest" --engine vllm $launch_args $leader_args $guard_args $proof_args \
    --served-model-name "$served_name" ${K3_PREFLIGHT_ARGS:-}) || rc=$?
printf '%s\n' "$report" | sed '$d'  # the table; the serve line is printed below, once ready
[ "$rc" -eq 0 ] || exit "$rc"
line=$(printf '%s\n' "$report" | sed -n '$s/^serve  *//p')
[ -n "$line" ] || die "k3ckpt preflight printed no serve line (k3ckpt too old?)"
printf '%s\n' "$line" >"$serve_file"
eval "set -- $line"
# shellcheck disable=SC2086
set -- "$@" ${K3_VLLM_ARGS:-}
echo "node-init: node $node is ready; serve it with:"
echo "$*"
