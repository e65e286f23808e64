"""``k3ckpt plan``, ``reshard``, ``unshard`` and ``preflight``: from a checkpoint to the files each
rank of a TP/EP topology loads, and the check that a node can load them."""

from __future__ import annotations

import sys

import click

from ..errors import EXIT_PROBLEMS
from ..format.topology import RankSelection
from ._options import (
    CONTEXT,
    AliasedChoice,
    ByteRate,
    ByteSize,
    Decorator,
    handle_errors,
    jobs_option,
    json_option,
    max_shard_size_option,
    size_option,
    topology_options,
)
from ._output import ByteProgress, emit_json

# help texts plan and reshard share
_TP = "Tensor-parallel degree of dense weights."
_PLACEMENT = "Expert placement: vLLM's linear rule or round robin."
_guard_option = click.option(
    "--guard/--no-guard", default=None,
    help="Serve with --load-format k3ckpt (vLLM refuses a launch that does not fit the directory and bytes that "
         "differ from their digests) [default: when k3ckpt's vLLM plugin is installed here; else the line goes "
         "without it, and a note says what that loses].")
_KV_BUDGET = "KV cache (and other runtime) memory to reserve per GPU."
_FORMAT = ("node: per node a checkpoint directory stock vLLM loads with --enable-expert-parallel "
           "--enable-ep-weight-filter (dense tensors whole, only the node's experts); rank: pre-split tensors "
           "per rank, for custom loaders - no stock engine reads pre-split tensors.")
#: --format's values; ``hf-node`` (the node format's first name) is accepted and not shown
_LAYOUTS = AliasedChoice(["node", "rank"], aliases=("hf-node",))


def _engine_topology(**extra: str) -> Decorator:
    """The topology options plan and reshard share, in the node format's reading; ``extra``:
    reshard's --ranks and --node."""
    return topology_options(
        show_defaults=False,
        tp=_TP + " [default: 1]",
        dp="Data-parallel degree: world size = tp x dp. With --format node, also the EP size is tp x dp, as in "
           "vLLM's expert parallel [default: world size / tp].",
        ep="Expert-parallel degree. --format node: must equal the world size (tp x dp), its default; "
           "--format rank: default 1 (experts cut over all ranks).",
        world_size="Ranks in all [default: tp x dp with --dp, else max(ep, tp)].",
        placement=_PLACEMENT + " [default: linear]",
        gpus_per_node="Ranks per node [default with --format node: the world size, one node holding everything].",
        **extra)


# -- plan --------------------------------------------------------------------------------------


@click.command(context_settings=CONTEXT)
@click.argument("source", type=click.Path(path_type=str))
@click.option("--format", "layout", type=_LAYOUTS, default="node", show_default=True,
              help=_FORMAT)
@_engine_topology()
@size_option("--kv-budget", default="20GiB", help=_KV_BUDGET)
@click.option("--link", type=ByteRate(), help="Time to ready: each node's network link, in bits (25Gbit/s) or bytes "
              "(3GB/s) per second. With --disk and --cores.")
@click.option("--disk", type=ByteRate(), help="Time to ready: each node's disk bandwidth, reads and writes together "
              "(7GB/s).")
@click.option("--cores", type=click.IntRange(1), help="Time to ready: each node's CPU cores.")
@click.option("--memory", type=ByteSize(), help="Time to ready, optional: each node's RAM (2TiB). hf download leaves "
              "up to 10 % of it for the kernel to write after it exits.")
@json_option()
@handle_errors
def plan(source: str, selection: RankSelection, kv_budget: int, as_json: bool, layout: str,
         link: float | None, disk: float | None, cores: int | None, memory: int | None) -> None:
    """What each rank of a TP/EP topology holds, and which accelerators fit it.

    SOURCE is a local checkpoint or a manifest (so a deployment can be planned before anything
    is downloaded: `k3ckpt manifest pull` makes one from hub metadata). Prints each rank's
    ep/tp/moe_tp rank and node, its experts, its bytes split into routed experts / TP-split
    dense / replicated, the largest rank, and the per-GPU need (weights x 1.15 + KV budget)
    against H100, H200, B200, GB300 and MI355X; with --format node (the default, as for
    reshard) also what each node directory holds on disk. Impossible topologies are refused
    with the precise reason (exit 2).

    With --link, --disk and --cores (each node's), also the time to ready of every node by
    three routes - fetch, verify and reshard; the one-step fetch --node; the naive hf download
    of everything, hf cache verify - each followed by vLLM's load, from the CPU-seconds per GB
    measured in BENCHMARKS.md: per step its start-up (longer where it reads every header, by
    the checkpoint's tensors) plus the longest of download / link, (read + write) / disk and
    CPU-s / cores.

    \b
    Examples:
      k3ckpt plan ./Kimi-K3 --tp 2 --dp 4
      k3ckpt plan kimi-k3.manifest.json --tp 8 --dp 2 --gpus-per-node 8
      k3ckpt plan ./Kimi-K3 --format rank --tp 8 --kv-budget 40GiB --json
      k3ckpt plan ./Kimi-K3 --tp 8 --dp 2 --gpus-per-node 8 --link 25Gbit/s --disk 7GB/s --cores 64
    """
    from ..deploy.estimate import Limits
    from ..deploy.plan import plan_topology, render_plan

    given = {"--link": link, "--disk": disk, "--cores": cores}
    if any(v is not None for v in given.values()) and any(v is None for v in given.values()):
        missing = ", ".join(k for k, v in given.items() if v is None)
        raise click.UsageError(f"--link, --disk and --cores go together (the time to ready needs all three): add {missing}")
    if memory is not None and link is None:
        raise click.UsageError("--memory is for the time to ready: add --link, --disk and --cores")
    limits = (Limits(link, disk, cores, memory) if link is not None and disk is not None and cores is not None
              else None)
    rep = plan_topology(source, selection, kv_budget=kv_budget, layout=layout, limits=limits)
    if as_json:
        emit_json(rep.to_json())
    else:
        click.echo(render_plan(rep))


# -- reshard -----------------------------------------------------------------------------------


@click.command(context_settings=CONTEXT)
@click.argument("source", type=click.Path(file_okay=False, path_type=str))
@click.option("-o", "--output", "out", required=True, type=click.Path(file_okay=False, path_type=str),
              help="Output directory (node-NNNNN/ or rank-NNNNN/ directories and topology.json).")
@click.option("--format", "layout", type=_LAYOUTS, default="node", show_default=True,
              help=_FORMAT)
@_engine_topology(ranks="--format rank: only these ranks, e.g. 0-3,8.",
                  node="Only this node (needs --gpus-per-node with --format rank).")
@max_shard_size_option("Files of at most this size (--format node: header included; --format rank: tensor bytes).")
@jobs_option("Output files written in parallel [default: 1 per CPU, at most 16].")
@click.option("--manifest", "manifest_path", type=click.Path(dir_okay=False, path_type=str),
              help="A tensor-hash manifest of SOURCE: whole tensors of files `k3ckpt verify --manifest` (or fetch) "
                   "found unchanged and equal to it take their sha256 from it instead of being hashed again "
                   "[default: the manifest the last full verify --manifest of SOURCE used, if unchanged].")
@click.option("--force", is_flag=True, help="Rewrite completed ranks too, and replace another topology this command "
              "wrote in OUT (never files k3ckpt did not write).")
@json_option("Machine-readable summary.")
@handle_errors
def reshard(source: str, out: str, selection: RankSelection, max_shard_size: int, jobs: int | None, layout: str,
            manifest_path: str | None, force: bool, as_json: bool) -> None:
    """Write a checkpoint as the directories each node (or rank) of a TP/DP/EP topology loads.

    --format node (the default): OUT/node-NNNNN/ is a checkpoint directory that stock vLLM
    loads with --enable-expert-parallel --enable-ep-weight-filter: every non-expert tensor whole
    in model-dense-*.safetensors, each rank's routed experts (whole) in files of their own,
    model-rank-RRRRR-experts-*.safetensors, an index listing exactly those files, the config,
    tokenizer and licence files, k3ckpt-node.json (per-tensor and per-file sha256; k3ckpt verify
    checks exactly the node's experts), then READY. The topology is vLLM's expert parallel:
    --tp T --dp D, EP size T x D = the world size (--ep E --tp T with E the world size says the
    same); a topology vLLM cannot run (--ep below the world size: experts cut) is refused with
    the nearest command that works.

    --format rank: the rank-layout contract, for custom loaders (no stock engine reads
    pre-split tensors): OUT/rank-NNNNN/ with model-rank-R-part-K.safetensors, rank-manifest.json
    and READY; split tensors are sliced by the TP rules, experts cut ep/world-size ways when
    --ep is below the world size.

    Streaming, bounded memory; contiguous byte runs are copied kernel-side. A node or rank whose
    READY exists, whose marker or manifest matches and whose files have the stat recorded when
    they were written is skipped on a re-run (--force redoes it); any other is rewritten from
    scratch. Every output file's sha256 is computed while it is written; a whole tensor's sha256
    is computed once per run, in the same read - or, with --manifest (by default the manifest the
    last full verify --manifest of SOURCE used), taken from the manifest for source files that
    verify or fetch last found unchanged and equal to it (any other file's tensors are hashed).
    OUT must be new, empty or an earlier reshard's output (a directory holding files
    k3ckpt did not write is refused, --force included); the run holds OUT/.k3ckpt-output.lock
    and checks free space before writing.

    \b
    Examples:
      k3ckpt reshard ./Kimi-K3 -o /nvme/k3-tp8 --tp 8
      k3ckpt reshard ./Kimi-K3 -o /nvme/k3-tp8-dp2 --tp 8 --dp 2 --gpus-per-node 8 --node 1
      k3ckpt reshard ./Kimi-K3 -o /nvme/k3-ep16 --ep 16 --tp 4 --gpus-per-node 4
      k3ckpt reshard ./Kimi-K3 -o ./k3-ranks --format rank --ep 8 --tp 2 --ranks 0-3 --max-shard-size 2GiB --json
      k3ckpt verify ./Kimi-K3 --manifest k3.json && k3ckpt reshard ./Kimi-K3 -o /nvme/k3 --tp 8 --manifest k3.json
    """
    from ..deploy.reshard import plan_reshard, render_reshard, run_reshard

    manifest = None
    if manifest_path is not None:
        from ..integrity.manifest import Manifest

        manifest = Manifest.load(manifest_path)
    plan = plan_reshard(source, selection, max_file_size=max_shard_size, layout=layout)
    with ByteProgress(not as_json, "resharding") as bar:
        res = run_reshard(plan, out, jobs=jobs, force=force, progress=bar, on_plan=bar.plan, manifest=manifest)
    if as_json:
        emit_json(res.to_json())
    else:
        click.echo(render_reshard(res))


# -- unshard -----------------------------------------------------------------------------------


@click.command(context_settings=CONTEXT)
@click.argument("layout", metavar="OUT", type=click.Path(file_okay=False, path_type=str))
@click.option("-o", "--output", "dest", required=True, type=click.Path(file_okay=False, path_type=str),
              help="Directory for the reassembled checkpoint.")
@max_shard_size_option("Tensor bytes per output shard (a larger tensor gets a shard of its own).")
@jobs_option("Shards written in parallel [default: min(CPUs, 8)].")
@click.option("--force", is_flag=True, help="Replace a checkpoint an earlier unshard wrote in the output directory "
              "(never files k3ckpt did not write).")
@json_option("Machine-readable summary.")
@handle_errors
def unshard(layout: str, dest: str, max_shard_size: int, jobs: int | None, force: bool, as_json: bool) -> None:
    """Reassemble a standard checkpoint from a complete per-rank layout (the inverse of reshard).

    OUT is a directory written by `k3ckpt reshard`. Every rank must be complete (READY); the
    manifests must agree with topology.json and the file headers, and every tensor's parts must
    tile it - anything else is refused with a one-line error naming the rank, file or tensor.
    Split tensors are concatenated along their dim; each slice read is hashed while copied and
    must match its manifest sha256. The output is a local-dir checkpoint
    (model-0000K-of-0000N.safetensors, model.safetensors.index.json written last, and the
    layout's config, tokenizer and other non-weight files) whose tensors are byte-identical to
    the source's. The output directory must be new, empty or an earlier unshard's output; the
    run holds its lock and checks free space first.

    \b
    Examples:
      k3ckpt unshard /nvme/k3-ep8-tp2 -o ./Kimi-K3-again
      k3ckpt unshard /nvme/k3-ep8-tp2 -o ./Kimi-K3-again --max-shard-size 2GiB --json
    """
    from ..deploy.unshard import plan_unshard, render_unshard, run_unshard

    plan = plan_unshard(layout)
    with ByteProgress(not as_json, "unsharding") as bar:
        res = run_unshard(plan, dest, max_shard_size=max_shard_size, jobs=jobs, force=force,
                          progress=bar, on_plan=bar.plan)
    if as_json:
        emit_json(res.to_json())
    else:
        click.echo(render_unshard(plan, res))


# -- preflight ---------------------------------------------------------------------------------


@click.command(context_settings=CONTEXT)
@click.argument("directory", type=click.Path(path_type=str))
@topology_options(ranks="Check these global ranks, e.g. 3 or 0-3,8 (as the other commands read --ranks).",
                  node="Check the ranks of this node (needs --gpus-per-node).",
                  gpus_per_node="Ranks per node.", ep="Expert-parallel degree the launcher uses.",
                  tp="Tensor-parallel degree the launcher uses.",
                  dp="Data-parallel degree the launcher uses (--engine: ep = tp x dp).",
                  world_size="World size the launcher uses [default: max(ep, tp); tp x dp with --dp].",
                  placement="Expert placement of the launch [--engine default: the directory's].")
@click.option("--engine", type=click.Choice(["vllm", "sglang"]),
              help="Check a node directory against this engine's expert-parallel launch and print its serve "
                   "command [default: vllm for a directory holding k3ckpt-node.json].")
@click.option("--no-expert-parallel", "no_expert_parallel", is_flag=True,
              help="The launch runs without expert parallelism (vLLM without --enable-expert-parallel, SGLang "
                   "without --ep-size): every rank reads every expert, cut by TP; a directory lacking any FAILs.")
@click.option("--leader-address", metavar="HOST",
              help="The serve command's leader (multi-node) [default: LWS_LEADER_ADDRESS / MASTER_ADDR, "
                   "else the placeholder LEADER_ADDRESS].")
@click.option("--rpc-port", type=click.IntRange(1, 65535), default=13345, show_default=True,
              help="vLLM's --data-parallel-rpc-port in the serve command (multi-node).")
@click.option("--served-model-name", metavar="NAME", help="The serve command's --served-model-name.")
@_guard_option
@click.option("--full", is_flag=True, help="Compare every rank file's sha256 (in parallel), not just sizes.")
@click.option("--io-test", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
              help="Measure read speed (O_DIRECT where possible) for up to this long.")
@size_option("--kv-budget", default="20GiB", help=_KV_BUDGET)
@size_option("--min-free-disk", default="1GiB",
             help="Free space the disk holding DIRECTORY should keep: less is a WARN (loading writes nothing "
                  "there; a FAIL only when ranks still to be written there do not fit; a read-only mount passes).")
@click.option("--no-env", is_flag=True, help="Ignore the launcher's variables (RANK, SLURM_*, ...).")
@click.option("--require-proof", is_flag=True,
              help="FAIL (exit 1) unless the bytes this node loads are proven (docs/trust.md); the init recipe's way.")
@jobs_option("Files hashed in parallel with --full [default: CPU count].")
@json_option("Machine-readable report.")
@handle_errors
def preflight(directory: str, selection: RankSelection, full: bool, io_test: float | None, kv_budget: int,
              min_free_disk: int, no_env: bool, require_proof: bool, jobs: int | None, as_json: bool, engine: str | None,
              leader_address: str | None, rpc_port: int, served_model_name: str | None,
              no_expert_parallel: bool, guard: bool | None) -> None:
    """Check, in seconds, that this node can load DIRECTORY before the engine boots.

    DIRECTORY is a per-rank layout written by `k3ckpt reshard` or a plain checkpoint (a full
    download, or an hf-node copy holding only this node's experts). Checks, each PASS / WARN /
    FAIL with a reason and, for a FAIL, the command that fixes it:
    topology.json against --ep/--tp/--world-size and the launcher's variables (RANK,
    WORLD_SIZE, LOCAL_RANK, SLURM_*, torchrun's, JOB_COMPLETION_INDEX); each of this node's
    ranks READY with every file of its manifest at its size (--full: its sha256) - or, for a
    plain checkpoint, its structure and the experts this node's ranks need; free disk, host
    RAM and GPU memory (nvidia-smi / rocm-smi) against weights x 1.15 + --kv-budget; MXFP4
    support; LICENSE kind, quantization format and source revision; with --io-test, read
    speed and the predicted load time. This node's ranks: --ranks, --node, else the launcher's
    variables, else all. Exits 0 when nothing FAILs, 1 when something does, 2 when it cannot
    run. Test hooks: K3CKPT_PREFLIGHT_FREE_BYTES and K3CKPT_PREFLIGHT_MEM_BYTES replace the
    measured free disk and available memory.

    A node directory (k3ckpt-node.json; or any checkpoint with --engine) is checked against the
    engine's launch, vLLM's expert parallel (ep = tp x dp): for every rank of this node every
    tensor it reads is present, no expert other nodes own is, every dense tensor is, and the
    marker was written for this tp, dp, placement, GPUs per node and node. The last line,
    `serve`, is this node's engine command (JSON: "serve"). --no-expert-parallel checks a launch
    without it (every rank reads every expert): the fix of a node directory is then the
    expert-parallel launch it was written for.

    \b
    Examples:
      k3ckpt preflight /nvme/k3-ep8-tp2 --node 0 --gpus-per-node 8
      k3ckpt preflight /nvme/k3-ep8-tp2 --ranks 3 --ep 8 --tp 2 --full --json
      k3ckpt preflight /nvme/Kimi-K3 --ep 8 --tp 8 --node 1 --gpus-per-node 8 --io-test 10
      k3ckpt preflight /nvme/k3/node-00001 --engine vllm --tp 8 --dp 2 --node 1 --gpus-per-node 8
    """
    from ..deploy.preflight import preflight as run_preflight
    from ..deploy.preflight import render_preflight

    with ByteProgress(not as_json, "checking (--full)") as bar:  # only --full reads enough to need one
        rep = run_preflight(directory, selection, full=full, io_test=io_test, kv_budget=kv_budget,
                            min_free_disk=min_free_disk, use_env=not no_env, jobs=jobs, engine=engine,
                            leader_address=leader_address, rpc_port=rpc_port, served_model_name=served_model_name,
                            progress=bar, on_plan=bar.plan, require_proof=require_proof,
                            expert_parallel=not no_expert_parallel, guard=guard)
    if as_json:
        emit_json(rep.to_json())
    else:
        click.echo(render_preflight(rep))
    if not rep.ok:
        sys.exit(EXIT_PROBLEMS)


# -- serve-command -----------------------------------------------------------------------------


@click.command("serve-command", context_settings=CONTEXT)
@click.argument("directory", type=click.Path(path_type=str))
@click.option("--engine", type=click.Choice(["vllm", "sglang"]), default="vllm", show_default=True,
              help="The engine to start.")
@click.option("--tp", type=click.IntRange(1), required=True, help="Tensor-parallel degree.")
@click.option("--dp", type=click.IntRange(1), default=1, show_default=True,
              help="Data-parallel degree (ep = tp x dp).")
@click.option("--placement", type=click.Choice(["linear", "round_robin"]), default="linear", show_default=True,
              help="Expert placement the directory was written for.")
@click.option("--node", type=click.IntRange(0), default=0, show_default=True, help="This node.")
@click.option("--gpus-per-node", type=click.IntRange(1), help="Ranks per node [default: tp x dp, one node].")
@click.option("--leader-address", metavar="HOST",
              help="The leader's address (multi-node) [default: LWS_LEADER_ADDRESS / MASTER_ADDR, else the "
                   "placeholder LEADER_ADDRESS, as preflight].")
@click.option("--rpc-port", type=click.IntRange(1, 65535), default=13345, show_default=True,
              help="vLLM's --data-parallel-rpc-port (multi-node).")
@click.option("--served-model-name", metavar="NAME", help="--served-model-name.")
@_guard_option
@json_option("The argv as a JSON list.")
@handle_errors
def serve_command(directory: str, engine: str, tp: int, dp: int, placement: str, node: int,
                  gpus_per_node: int | None, leader_address: str | None, rpc_port: int,
                  served_model_name: str | None, guard: bool | None, as_json: bool) -> None:
    """Print the engine command that serves node directory DIRECTORY on this node.

    The line `k3ckpt preflight` prints as `serve` after checking the directory, without the
    check (DIRECTORY need not exist yet): vLLM's expert parallel over tp x dp ranks with the
    weight filter and the placement, and for several nodes the data-parallel flags (node 0
    serves the API, the others run --headless from their first DP rank). The leader is
    --leader-address, else LWS_LEADER_ADDRESS / MASTER_ADDR, else the placeholder
    LEADER_ADDRESS - as preflight reads it. With --load-format k3ckpt when k3ckpt's vLLM
    plugin is installed here (--guard / --no-guard decide); without it a note on stderr says
    what the line lacks. Shell-quoted.

    \b
    Examples:
      k3ckpt serve-command /nvme/k3 --tp 8
      k3ckpt serve-command /nvme/k3 --tp 8 --dp 2 --gpus-per-node 8 --node 1 --leader-address gpu01
    """
    import os
    import shlex

    from ..deploy.serve import UNGUARDED, leader_from_env, resolve_guard
    from ..deploy.serve import serve_command as build

    guarded = resolve_guard(guard, engine)
    argv = build(directory, tp=tp, dp=dp, placement=placement, node=node, gpus_per_node=gpus_per_node,
                 leader_address=leader_address or leader_from_env(os.environ), rpc_port=rpc_port,
                 served_model_name=served_model_name, engine=engine, guard=guarded)
    if as_json:
        emit_json({"serve": argv, "guarded": guarded})
        return
    click.echo(shlex.join(argv))
    if engine == "vllm" and not guarded:  # on stderr: $(k3ckpt serve-command ...) takes the line alone
        click.echo(f"note: {UNGUARDED}", err=True)


COMMANDS = [plan, reshard, unshard, preflight, serve_command]
