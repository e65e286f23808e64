"""``k3ckpt preflight``: will this node boot the model? Answered in seconds, before the engine.

Run from an init container, a Slurm prolog or a systemd unit on the directory a node will load:
a per-rank layout (``k3ckpt reshard``'s ``topology.json`` + ``rank-NNNNN/``), or a plain
checkpoint (a full download or an ``hf-node`` copy that holds only the node's experts). Every
check ends as a row ``PASS`` / ``WARN`` / ``FAIL`` with a one-line reason and, for a FAIL, the
command that fixes it. Only a FAIL makes the run exit 1.

Which ranks are "this node's", in order: ``--ranks`` (one rank, or several: ``0-3,8``, read
as every command reads it); ``--node N --gpus-per-node G``; the
launcher's node index (``GROUP_RANK``, ``SLURM_NODEID``, ``JOB_COMPLETION_INDEX``) with the
ranks per node (``--gpus-per-node`` or ``LOCAL_WORLD_SIZE`` / ``SLURM_NTASKS_PER_NODE``); the
launcher's global rank (``RANK``, ``SLURM_PROCID``); otherwise every rank of the topology.

Decisions the issue leaves open:

- rank layout completeness is by the rank's ``rank-manifest.json``: every file it lists present
  with its size (``--full``: its sha256, files hashed in parallel), its rank numbers and
  experts those of ``topology.json``, its source digest that of ``topology.json``;
- the fix for a broken rank is the ``k3ckpt reshard`` of exactly those ranks, with the source
  path ``topology.json`` records (``SRC`` when it records none); ``--force`` is added when a
  file's content (not its size) is wrong, because a re-run skips ranks whose sizes match;
- plain checkpoints get verify's structure checks without its "experts missing" findings
  (an ``hf-node`` copy lacks other nodes' experts by design) and a coverage check of the
  experts this node's ranks need; with no ``--ep``/``--tp`` every expert is needed. They carry
  no per-file digests, so ``--full`` scans their E8M0 scales for NaN bytes instead;
- "ready to load" needs what an engine reads beside the weights, by the rule ``reshard``
  applies to its source (:mod:`k3ckpt.format.loadable`): a readable ``config.json``, the
  tokenizer files ``tokenizer_config.json`` names, a licence - each missing one a FAIL naming
  it, following symlinks (an HF cache snapshot); a check that could not run (expert coverage
  without a config) is a WARN "not checked", never a PASS;
- a fix never overwrites another topology or another node's share, and never names a path in
  a Hugging Face cache repo folder: those go to a new directory (``new_output_dir``); only
  the directory's own ranks or node are rewritten in place; a missing side file is ``cp -n``
  from the recorded source, fetched, or (in an HF cache) ``hf download``-ed by the cache's
  client;
- capacity: the GPU need of a rank is
 :func:`k3ckpt.plan` 's rule (weights x 1.15 + KV budget)
  against the device's free memory (total - used); host RAM is checked against one weight
  file per local rank (loaders stage a file at a time) and only WARNs; the directory is read,
  never written, by preflight and the engine: a read-only mount PASSes the disk check, free
  space below ``--min-free-disk`` only WARNs, and a FAIL is for the node's incomplete ranks
  when what they still need does not fit (or the mount is read-only);
- the environment is compared by its highest-priority variable per field (see
  :func:`k3ckpt.topology.rank_from_env`); ``--no-env`` skips it for a prolog whose variables
  describe the allocation rather than the job.

A node directory and an engine (``--engine vllm|sglang``; :mod:`._preflight_engine`):

- ``--engine vllm`` is the default for a directory holding ``k3ckpt-node.json`` (it was written
  for an engine launch, so that is the check that matters); any other directory keeps the
  checks above unless ``--engine`` is given (a rank layout is refused: no engine reads it);
- the launch is vLLM's expert parallel: ep = tp x dp = the world size; options not given come
  from the marker (placement, GPUs per node, node) after the launcher's variables;
- the marker must have been written for exactly that launch (a FAIL even where the bytes
  would be equal, e.g. tp 1 x dp 4 for tp 2 x dp 2: the marker would misdescribe the directory);
  experts other nodes own FAIL a node directory but only WARN a full download (vLLM's filter
  skips them; they cost disk and scale reads, not correctness);
- ``--engine vllm`` FAILs round_robin over several ranks for a model without several expert
  groups (``n_group``/``num_expert_group``): vLLM's layers then place linearly while its filter
  keeps round_robin's experts, and most local expert slots (half at ep 2) are never loaded, silently (``reshard``
  and ``fetch --node`` refuse to write such a directory: this catches an older one, or an edited
  config);
- ``--no-expert-parallel``: the launch has no expert parallelism, so every rank reads every
  expert (cut by TP) and a directory lacking any FAILs - the launch vLLM itself loads without an
  error and answers wrong from; the fix is the expert-parallel launch the marker records;
- ``--engine sglang`` FAILs round_robin and expert counts not divisible by ep (SGLang 0.5.23
  asserts while building the model: the launch would not start);
- under ``srun --ntasks-per-node=1`` SLURM_PROCID/SLURM_NTASKS count nodes: they give the node
  index only (:func:`launcher_env`); LeaderWorkerSet's ``LWS_WORKER_INDEX`` is a node index.

Test hooks (documented, read from the same environment as the launcher variables):
``K3CKPT_PREFLIGHT_FREE_BYTES`` replaces the free disk bytes ``statvfs`` reports and
``K3CKPT_PREFLIGHT_MEM_BYTES`` the ``MemAvailable`` of ``/proc/meminfo``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

from ..errors import PreflightError
from ..format.checkpoint import resolve_root
from ..format.layout import NODE_MARKER, TOPOLOGY_NAME
from ..format.topology import RankEnv, RankSelection
from ._memory import DEFAULT_KV_BUDGET
from ._preflight_engine import EngineNodeDir
from ._preflight_host import (
    DEFAULT_MIN_FREE_DISK,
    FREE_BYTES_HOOK,
    MEM_BYTES_HOOK,
    io_check,
    license_kind,
    measure_read_speed,
    query_gpus,
)
from ._preflight_proof import checkpoint_proof, layout_proof
from ._preflight_ranks import (
    PlainCheckpoint,
    RankLayout,
    Request,
    check_environment,
    launcher_env,
    ranks_of_spec,
    select_ranks,
)
from ._preflight_report import (
    FAIL,
    PASS,
    WARN,
    Check,
    GpuDevice,
    PreflightReport,
    ReadSpeed,
    fetch_command,
    render_preflight,
    reshard_command,
)
from .serve import DEFAULT_RPC_PORT, ENGINES, leader_from_env, resolve_guard, serve_command

__all__ = [
    "DEFAULT_MIN_FREE_DISK",
    "FAIL",
    "FREE_BYTES_HOOK",
    "MEM_BYTES_HOOK",
    "PASS",
    "WARN",
    "Check",
    "GpuDevice",
    "PreflightReport",
    "ReadSpeed",
    "check_environment",
    "fetch_command",
    "license_kind",
    "measure_read_speed",
    "preflight",
    "query_gpus",
    "render_preflight",
    "reshard_command",
    "select_ranks",
    "serve_command",
]


# ---------------------------------------------------------------------------------------------
# The entry point

#: A world larger than any: ``--ranks`` is checked for its form before the topology is known.
_ANY_WORLD = 1 << 40


def preflight(
    path: str | os.PathLike[str],
    selection: RankSelection = RankSelection(),
    *,
    full: bool = False,
    io_test: float | None = None,
    kv_budget: int = DEFAULT_KV_BUDGET,
    min_free_disk: int = DEFAULT_MIN_FREE_DISK,
    use_env: bool = True,
    environ: Mapping[str, str] | None = None,
    jobs: int | None = None,
    engine: str | None = None,
    leader_address: str | None = None,
    rpc_port: int = DEFAULT_RPC_PORT,
    served_model_name: str | None = None,
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
    require_proof: bool = False,
    expert_parallel: bool = True,
    guard: bool | None = None,
) -> PreflightReport:
    """Check that the directory ``path`` is ready for this node to load.

    Args:
        selection: this node's ranks - ``ranks`` (``"3"``, ``"0-3,8"`` or a list) or ``node`` + ``gpus_per_node``
            (default: from the launcher's environment, else every rank) - and the topology the
            launcher will use (``ep`` / ``tp`` / ``world_size`` / ``placement``): compared with
            ``topology.json``, or (plain checkpoint) the one whose experts must be present.
        full: compare sha256 of every rank file instead of sizes.
        io_test: seconds to spend measuring the read speed of this node's weight files.
        kv_budget: per-GPU memory to reserve beyond the weights x 1.15.
        min_free_disk: free bytes the disk holding ``path`` should keep (less is a WARN: loading writes nothing there).
        use_env: compare with (and select ranks from) the launcher's variables.
        environ: the environment to read (default ``os.environ``); the test hooks
            :data:`FREE_BYTES_HOOK` and :data:`MEM_BYTES_HOOK` are read from it too.
        engine: ``"vllm"`` or ``"sglang"``: check a node directory (or any plain checkpoint)
            against that engine's expert-parallel launch of ``selection`` (``tp`` x ``dp`` =
            ep; default: the launch ``k3ckpt-node.json`` records) and put its command line in
            :attr:`PreflightReport.serve`. Default: ``"vllm"`` for a directory holding
            ``k3ckpt-node.json``, else none (the checks of a plain checkpoint or rank layout).
        leader_address, rpc_port, served_model_name: for the serve command (:func:`serve_command`);
            the leader's address defaults to ``LWS_LEADER_ADDRESS`` / ``MASTER_ADDR``, else the
            placeholder ``LEADER_ADDRESS``.
        progress, on_plan: ``full``'s progress: called with the bytes it will read (every rank
            file, or a checkpoint's E8M0 scales), then with the bytes as they are read.
        require_proof: the ``proof`` row FAILs (instead of WARNs) when the bytes this node loads
            are not proven (docs/trust.md): what an init container that hands over to the engine
            asks for. Without it the report says "loadable, not proven", never "ready to load".
        expert_parallel: with ``engine``, whether the launch uses the engine's expert parallelism
            (vLLM ``--enable-expert-parallel``, the launch the serve line prints). ``False``: every
            rank reads every expert (cut by TP), so a directory lacking any FAILs, the fix naming
            the expert-parallel launch the directory was written for.
        guard: with vLLM, whether the serve lines load with ``--load-format k3ckpt`` (the
            engine then refuses a launch that does not fit the directory and bytes that differ
            from their digests; :attr:`PreflightReport.guarded`). Default: when k3ckpt's vLLM
            plugin is installed here (:func:`~k3ckpt.deploy.serve.guard_installed`); without
            it the text report says what the line lacks.

    Raises:
        PreflightError / TopologyError: ``path`` is missing or holds neither a rank layout nor
            a checkpoint, or the options contradict each other (exit 2).
    """
    root = Path(path).expanduser()
    if not root.is_dir():
        raise PreflightError(f"{root}: no such directory", path=root)
    # An HF cache repo folder (models--org--name) is the snapshot refs/main names: the serve line
    # must name the folder holding config.json, not the cache's bookkeeping around it.
    root, _ = resolve_root(root)
    env = os.environ if environ is None else environ
    if selection.ranks is not None:
        if selection.node is not None:
            raise PreflightError("give --ranks or --node, not both")
        ranks_of_spec(selection.ranks, _ANY_WORLD)  # not ranks at all: before anything is read
    if selection.node is not None and selection.gpus_per_node is None:
        raise PreflightError("--node needs --gpus-per-node")
    ask = Request(selection, full, kv_budget, min_free_disk, jobs,
                   launcher_env(env) if use_env else RankEnv(), env, progress, on_plan)
    rank_layout = (root / TOPOLOGY_NAME).exists() or any(root.glob("rank-[0-9]*"))
    if engine is None and not rank_layout and (root / NODE_MARKER).is_file():
        engine = "vllm"  # a node directory is written for an engine launch: check that one
    if not expert_parallel and engine is None:
        raise PreflightError("--no-expert-parallel describes an engine launch: give --engine")
    if guard and engine is None:
        raise PreflightError("--guard is for the serve line of an engine launch: give --engine")
    if engine is not None:
        if engine not in ENGINES:
            raise PreflightError(f"unknown engine {engine!r}: use {' or '.join(ENGINES)}")
        if rank_layout:
            raise PreflightError(f"{root}: a rank layout (pre-split tensors, for custom loaders) is read by no "
                                 f"engine; preflight a node directory (k3ckpt reshard --format node) with --engine")
        guarded = resolve_guard(guard, engine)  # TopologyError: --guard of SGLang (exit 2)
        leader = leader_address or (leader_from_env(env) if use_env else None)
        report = EngineNodeDir(root, ask, engine, leader, rpc_port, served_model_name, expert_parallel,
                               guarded).run()
    elif rank_layout:
        report = RankLayout(root, ask).run()
    else:
        report = PlainCheckpoint(root, ask).run()
    if report.layout == "rank-layout":
        report.checks.append(layout_proof(root, {r: root / f"rank-{r:05d}" for r in report.ranks},
                                          require=require_proof))
    else:
        report.checks.append(checkpoint_proof(root, full=full, require=require_proof, jobs=jobs, progress=progress))
    if io_test:
        io_check(report, io_test)
    report.path = str(Path(path))  # as given; fix commands carry the absolute path
    return report
