"""``k3ckpt preflight``: will this node boot the model? Answered in seconds, before the engine.

Run from an init container, a Slurm prolog or a systemd unit on the directory a node will load:
a per-rank layout (``k3ckpt reshard``'s ``topology.json`` + ``rank-NNNNN/``), or a plain
checkpoint (a full download or an ``hf-node`` copy that holds only the node's experts). Every
check ends as a row ``PASS`` / ``WARN`` / ``FAIL`` with a one-line reason and, for a FAIL, the
command that fixes it. Only a FAIL makes the run exit 1.

Which ranks are "this node's", in order: ``--rank R``; ``--node N --gpus-per-node G``; the
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
- capacity: the GPU need of a rank is :func:`k3ckpt.plan` 's rule (weights x 1.15 + KV budget)
  against the device's free memory (total - used); host RAM is checked against one weight
  file per local rank (loaders stage a file at a time) and only WARNs; the disk must keep
  ``--min-free-disk`` free plus whatever the node's incomplete ranks still need;
- the environment is compared by its highest-priority variable per field (see
  :func:`k3ckpt.topology.rank_from_env`); ``--no-env`` skips it for a prolog whose variables
  describe the allocation rather than the job.

Test hooks (documented, read from the same environment as the launcher variables):
``K3CKPT_PREFLIGHT_FREE_BYTES`` replaces the free disk bytes ``statvfs`` reports and
``K3CKPT_PREFLIGHT_MEM_BYTES`` the ``MemAvailable`` of ``/proc/meminfo``.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import shlex
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..env import K3CKPT_PREFLIGHT_FREE_BYTES, K3CKPT_PREFLIGHT_MEM_BYTES
from ..errors import CheckpointNotFoundError, ConfigError, PreflightError
from ..format.checkpoint import Checkpoint, open_checkpoint
from ..format.config import ModelConfig, load_config
from ..format.inspect import MISSING_EXPERTS
from ..format.layout import FORMAT, MANIFEST_NAME, READY_NAME, TOPOLOGY_NAME, rank_dir_name
from ..format.roles import Kind, classify
from ..format.topology import (
    RankEnv,
    RankSelection,
    Topology,
    TopologyError,
    is_mxfp4,
    rank_from_env,
    ranks_of_node,
    tensors_for_ranks,
)
from ..integrity.hashing import hash_files
from ..utils import format_ranges, human_bytes, load_json
from .plan import DEFAULT_KV_BUDGET, WEIGHT_OVERHEAD

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
#: Test hook: free disk bytes to use instead of what ``statvfs`` says.
FREE_BYTES_HOOK = K3CKPT_PREFLIGHT_FREE_BYTES.name
#: Test hook: available host memory to use instead of ``/proc/meminfo``'s ``MemAvailable``.
MEM_BYTES_HOOK = K3CKPT_PREFLIGHT_MEM_BYTES.name
DEFAULT_MIN_FREE_DISK = 1024**3
#: How long ``nvidia-smi`` / ``rocm-smi`` may take before the GPU check gives up on it.
GPU_QUERY_TIMEOUT = 15.0
#: Bytes per read of the read-speed test (a multiple of every O_DIRECT alignment).
IO_BUFFER = 16 * 1024 * 1024
LICENSE_NAMES = ("LICENSE", "LICENSE.md", "LICENSE.txt", "LICENCE", "COPYING")

#: GPU name fragments -> how MXFP4 weights run there (k3-checkpoint.md: Hopper has no FP4).
MXFP4_NATIVE = ("B200", "B300", "GB200", "GB300", "BLACKWELL", "MI355", "MI350")
MXFP4_WEIGHT_ONLY = ("H100", "H200", "H800", "H20", "GH200")


@dataclass
class Check:
    """One row of the report."""

    name: str
    status: str  # PASS / WARN / FAIL
    reason: str
    fix: str | None = None  # the command that fixes a FAIL (or a WARN, when there is one)
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "reason": self.reason, "fix": self.fix,
                "details": self.details}


@dataclass
class ReadSpeed:
    """What ``--io-test`` measured."""

    bytes_read: int
    seconds: float
    readers: int
    direct: bool  # O_DIRECT throughout; False: buffered reads after POSIX_FADV_DONTNEED
    files: int
    note: str = ""

    @property
    def bytes_per_second(self) -> float:
        return self.bytes_read / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"bytes_read": self.bytes_read, "seconds": round(self.seconds, 3), "readers": self.readers,
                "direct": self.direct, "files": self.files, "note": self.note,
                "bytes_per_second": int(self.bytes_per_second)}


@dataclass
class GpuDevice:
    index: int  # as the tool numbers it
    name: str
    total: int  # bytes
    used: int

    @property
    def free(self) -> int:
        return max(self.total - self.used, 0)


@dataclass
class PreflightReport:
    path: str
    layout: str  # "rank-layout" or "checkpoint"
    topology: dict[str, Any] | None
    ranks: list[int]
    selection: str  # how the ranks were chosen
    checks: list[Check] = field(default_factory=list)
    read_speed: ReadSpeed | None = None
    #: What this node loads: the weight files to read for ``--io-test`` and their bytes.
    load_files: list[Path] = field(default_factory=list, repr=False)
    node_bytes: int = 0
    fix_all: str | None = None  # one command for every broken rank, when several are


    @property
    def ok(self) -> bool:
        """Nothing FAILs (WARNs allowed)."""
        return not any(c.status == FAIL for c in self.checks)

    def counts(self) -> dict[str, int]:
        return {s: sum(c.status == s for c in self.checks) for s in (FAIL, WARN, PASS)}

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "layout": self.layout, "topology": self.topology, "ranks": self.ranks,
                "selection": self.selection, "ok": self.ok, "counts": self.counts(),
                "checks": [c.to_json() for c in self.checks], "fix_all": self.fix_all,
                "read_speed": self.read_speed.to_json() if self.read_speed else None}


# ---------------------------------------------------------------------------------------------
# The entry point


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
) -> PreflightReport:
    """Check that the directory ``path`` is ready for this node to load.

    Args:
        selection: this node's ranks - one rank (``ranks=[R]``) or ``node`` + ``gpus_per_node``
            (default: from the launcher's environment, else every rank) - and the topology the
            launcher will use (``ep`` / ``tp`` / ``world_size`` / ``placement``): compared with
            ``topology.json``, or (plain checkpoint) the one whose experts must be present.
        full: compare sha256 of every rank file instead of sizes.
        io_test: seconds to spend measuring the read speed of this node's weight files.
        kv_budget: per-GPU memory to reserve beyond the weights x 1.15.
        min_free_disk: free bytes the disk holding ``path`` must keep.
        use_env: compare with (and select ranks from) the launcher's variables.
        environ: the environment to read (default ``os.environ``); the test hooks
            :data:`FREE_BYTES_HOOK` and :data:`MEM_BYTES_HOOK` are read from it too.

    Raises:
        PreflightError / TopologyError: ``path`` is missing or holds neither a rank layout nor
            a checkpoint, or the options contradict each other (exit 2).
    """
    root = Path(path).expanduser()
    if not root.is_dir():
        raise PreflightError(f"{root}: no such directory")
    root = root.resolve()
    env = os.environ if environ is None else environ
    rank = _one_rank(selection.ranks)
    if rank is not None and selection.node is not None:
        raise PreflightError("give --rank or --node, not both")
    if selection.node is not None and selection.gpus_per_node is None:
        raise PreflightError("--node needs --gpus-per-node")
    ask = _Request(rank, selection, full, kv_budget, min_free_disk, jobs,
                   rank_from_env(env) if use_env else RankEnv(), env)
    if (root / TOPOLOGY_NAME).exists() or any(root.glob("rank-[0-9]*")):
        report = _RankLayout(root, ask).run()
    else:
        report = _PlainCheckpoint(root, ask).run()
    if io_test:
        _io_check(report, io_test)
    report.path = str(Path(path))  # as given; fix commands carry the absolute path
    return report


def _one_rank(ranks: str | Sequence[int] | None) -> int | None:
    """The one rank a selection names (preflight checks one rank or one node), if any."""
    if ranks is None:
        return None
    if isinstance(ranks, str):
        if ranks.strip().isdigit():
            return int(ranks)
    elif len(ranks) == 1:
        return ranks[0]
    raise PreflightError(f"preflight checks one rank or one node, not ranks {ranks!r}")


@dataclass
class _Request:
    rank: int | None  # the selection's one rank
    selection: RankSelection
    full: bool
    kv_budget: int
    min_free_disk: int
    jobs: int | None
    env: RankEnv
    environ: Mapping[str, str]

    @property
    def per_node(self) -> int | None:
        """Ranks per node: ``--gpus-per-node``, else the launcher's."""
        return self.selection.gpus_per_node or self.env.local_world_size

    def select(self, world_size: int) -> tuple[list[int], str]:
        """This node's ranks of a world of ``world_size`` and how they were chosen."""
        return select_ranks(world_size, rank=self.rank, node=self.selection.node,
                            gpus_per_node=self.selection.gpus_per_node, env=self.env)

    def check_environment(self, world_size: int | None, ranks: list[int]) -> Check:
        """:func:`check_environment` with this request's options."""
        return check_environment(self.env, world_size, ranks, rank=self.rank, node=self.selection.node,
                                 gpus_per_node=self.selection.gpus_per_node)


# ---------------------------------------------------------------------------------------------
# Which ranks, and does the launcher agree


def select_ranks(
    world_size: int, *, rank: int | None, node: int | None, gpus_per_node: int | None, env: RankEnv,
) -> tuple[list[int], str]:
    """This node's ranks and how they were chosen (see the module docstring for the order).

    Raises:
        TopologyError: ``rank`` or ``node`` is outside the topology (an explicit option; an
            out-of-range launcher variable is reported by the environment check instead).
    """
    if rank is not None:
        if not 0 <= rank < world_size:
            raise TopologyError(f"--rank {rank} out of range 0..{world_size - 1} (world size {world_size})")
        return [rank], f"--rank {rank}"
    if node is not None:
        assert gpus_per_node is not None
        return ranks_of_node(node, gpus_per_node, world_size), f"--node {node} ({gpus_per_node} GPUs per node)"
    per_node = gpus_per_node or env.local_world_size
    if env.node is not None and per_node:
        try:
            ranks = ranks_of_node(env.node, per_node, world_size)
            return ranks, f"node {env.node} from {env.sources['node']} ({per_node} GPUs per node)"
        except TopologyError:
            pass  # the environment check names the bad variable
    if env.rank is not None and env.rank < world_size:
        return [env.rank], f"rank {env.rank} from {env.sources['rank']}"
    return list(range(world_size)), "all ranks (no --rank/--node and no launcher variables)"


def check_environment(env: RankEnv, world_size: int | None, ranks: list[int], *, rank: int | None,
                      node: int | None, gpus_per_node: int | None) -> Check:
    """The launcher's variables against the topology, the options and each other."""
    if not env.found and not env.problems:
        return Check("environment", PASS, "no launcher variables set (RANK, WORLD_SIZE, SLURM_*, "
                                          "JOB_COMPLETION_INDEX...): nothing to compare")
    per_node = gpus_per_node or env.local_world_size
    bad = [*env.problems, *_env_vs_topology(env, world_size, per_node),
           *_env_vs_options(env, ranks, rank, node, gpus_per_node)]
    if per_node:
        bad += _env_vs_node_size(env, rank, per_node)
    src = env.sources
    seen = ", ".join(f"{src[k]}={getattr(env, k)}" for k in ("rank", "world_size", "local_rank",
                                                              "local_world_size", "node") if k in src)
    if bad:
        return Check("environment", FAIL, "; ".join(bad), details={"variables": seen})
    return Check("environment", PASS, f"{seen} agree with the topology", details={"variables": seen})


def _env_vs_topology(env: RankEnv, world_size: int | None, per_node: int | None) -> list[str]:
    src = env.sources
    bad: list[str] = []
    if world_size is None:
        return bad
    if env.world_size is not None and env.world_size != world_size:
        bad.append(f"{src['world_size']}={env.world_size} but the topology has world size {world_size}")
    if env.rank is not None and env.rank >= world_size and env.world_size is None:
        bad.append(f"{src['rank']}={env.rank} is outside world size {world_size}")
    if per_node and env.node is not None and env.node * per_node >= world_size:
        last = (world_size - 1) // per_node
        bad.append(f"{src['node']}={env.node} but world size {world_size} with {per_node} per node has "
                   + (f"nodes 0..{last}" if last else "node 0"))
    return bad


def _env_vs_options(env: RankEnv, ranks: list[int], rank: int | None, node: int | None,
                    gpus_per_node: int | None) -> list[str]:
    src, bad = env.sources, []
    if env.rank is not None:
        if rank is not None and env.rank != rank:
            bad.append(f"{src['rank']}={env.rank} but --rank {rank}")
        elif rank is None and env.rank not in ranks and (node is not None or env.node is not None):
            bad.append(f"{src['rank']}={env.rank} is not one of this node's ranks {format_ranges(ranks)}")
    if node is not None and env.node is not None and env.node != node:
        bad.append(f"{src['node']}={env.node} but --node {node}")
    if gpus_per_node and env.local_world_size is not None and env.local_world_size != gpus_per_node:
        bad.append(f"{src['local_world_size']}={env.local_world_size} but --gpus-per-node {gpus_per_node}")
    return bad


def _env_vs_node_size(env: RankEnv, rank: int | None, per_node: int) -> list[str]:
    """Local rank and node index must be what the global rank implies with ``per_node`` ranks
    per node (torchrun and srun number ranks node by node)."""
    src, bad = env.sources, []
    me = env.rank if env.rank is not None else rank
    if me is not None and env.local_rank is not None and me % per_node != env.local_rank:
        who = f"{src['rank']}={me}" if env.rank is not None else f"--rank {me}"
        bad.append(f"{src['local_rank']}={env.local_rank} but {who} is local rank {me % per_node} "
                   f"of {per_node} per node")
    if env.rank is not None and env.node is not None and env.rank // per_node != env.node:
        bad.append(f"{src['node']}={env.node} but {src['rank']}={env.rank} is on node {env.rank // per_node} "
                   f"({per_node} per node)")
    return bad


# ---------------------------------------------------------------------------------------------
# Rank layout


@dataclass
class _RankState:
    rank: int
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    content_bad: bool = False  # a file's bytes (not its size) differ: reshard needs --force
    files: dict[str, int] = field(default_factory=dict)  # rank-dir/file -> expected size
    digests: dict[str, str] = field(default_factory=dict)  # rank-dir/file -> expected sha256
    quant: tuple[int, int] | None = None  # (MXFP4 weights, FP8 tensors) of its manifest

    @property
    def weight_bytes(self) -> int:
        return sum(self.files.values())


class _RankLayout:
    def __init__(self, root: Path, ask: _Request) -> None:
        self.root = root
        self.ask = ask
        self.checks: list[Check] = []
        self.topo: Topology | None = None
        self.tj: dict[str, Any] = {}

    def run(self) -> PreflightReport:
        ask = self.ask
        self._topology()
        if self.topo is None:  # nothing says which ranks exist: what can be checked still is
            self.checks.append(ask.check_environment(ask.selection.world_size, []))
            self.checks += _provenance_files(self.root, None, None)
            return PreflightReport(str(self.root), "rank-layout", None, [], "none: no usable topology.json",
                                   self.checks)
        topo = self.topo
        ranks, how = ask.select(topo.world_size)
        self.checks.append(ask.check_environment(topo.world_size, ranks))
        states = [self._rank_state(r) for r in ranks]
        if ask.full:
            self._compare_digests(states)
        self.checks += [self._rank_row(s) for s in states]
        self.checks += self._capacity(states)
        self.checks += self._provenance(states)
        summary = {k: v for k, v in self.tj.items() if k != "experts_by_rank"}  # ep lists: long, and in the file
        broken = [s for s in states if s.problems]
        fix_all = (self._fix(topo, [s.rank for s in broken], force=any(s.content_bad for s in broken))
                   if len(broken) > 1 else None)
        return PreflightReport(str(self.root), "rank-layout", summary, ranks, how, self.checks,
                               load_files=[self.root / f for s in states if not s.problems for f in s.files],
                               node_bytes=sum(s.weight_bytes for s in states), fix_all=fix_all)

    # -- topology.json ---------------------------------------------------------------------------

    def _topology(self) -> None:
        path = self.root / TOPOLOGY_NAME
        try:
            tj, _ = load_json(path, PreflightError)
        except PreflightError as e:
            self.checks.append(Check("topology", FAIL, str(e), fix=self._fix(None, [], force=True)))
            return
        if isinstance(tj, dict):
            self.tj = tj  # even an invalid one may name the source the fix needs
        if not isinstance(tj, dict) or tj.get("format") != FORMAT:
            self.checks.append(Check("topology", FAIL, f"{path}: not a {FORMAT} topology.json",
                                     fix=self._fix(None, [], force=True)))
            return
        self.tj = tj
        try:
            # Unchecked JSON values on purpose: Topology validates its fields and raises TopologyError.
            topo = Topology(tj.get("ep"), tj.get("tp"), tj.get("world_size"), tj.get("expert_placement"),  # type: ignore[arg-type]
                            tj.get("num_experts"))  # type: ignore[arg-type]
        except TopologyError as e:
            self.checks.append(Check("topology", FAIL, f"{path}: {e}", fix=self._fix(None, [], force=True)))
            return
        if tj.get("experts_by_rank") != topo.experts_by_ep_rank():
            self.checks.append(Check("topology", FAIL, f"{path}: experts_by_rank is not the {topo.placement} "
                                     f"placement of {topo.num_experts} experts over ep {topo.ep}",
                                     fix=self._fix(topo, [], force=True)))
            return
        self.topo = topo
        desc = _describe(topo)
        sel = self.ask.selection
        want = {"--ep": sel.ep, "--tp": sel.tp, "--world-size": sel.world_size, "--placement": sel.placement}
        have = {"--ep": topo.ep, "--tp": topo.tp, "--world-size": topo.world_size, "--placement": topo.placement}
        if sel.ep is not None or sel.tp is not None:
            # a world size left out means the default max(ep, tp), as every command reads it
            want["--world-size"] = sel.world_size or max(sel.ep or topo.ep, sel.tp or topo.tp)
        diff = [f"{k} {v} (layout has {have[k]})" for k, v in want.items() if v is not None and v != have[k]]
        if diff:
            self.checks.append(Check("topology", FAIL, f"{TOPOLOGY_NAME} is {desc}; requested " + ", ".join(diff),
                                     fix=self._requested_fix(topo)))
            return
        asked = " (as requested)" if any(v is not None for v in want.values()) else ""
        self.checks.append(Check("topology", PASS, f"{TOPOLOGY_NAME}: {desc}{asked}"))

    def _requested_fix(self, topo: Topology) -> str | None:
        """Reshard this node's ranks for the requested topology, replacing the layout."""
        ask = self.ask
        try:
            sel = ask.selection
            want = Topology.make(sel.ep or topo.ep, sel.tp or topo.tp, sel.world_size, sel.placement or topo.placement,
                                 num_experts=topo.num_experts)
            ranks, _ = ask.select(want.world_size)
        except TopologyError:
            return None
        return self._fix(want, ranks, force=True)

    def _fix(self, topo: Topology | None, ranks: list[int], *, force: bool) -> str:
        src = (self.tj.get("source") or {}).get("path") if isinstance(self.tj.get("source"), dict) else None
        return reshard_command(src, self.root, topo, ranks, force=force)

    # -- ranks -------------------------------------------------------------------------------------

    def _rank_state(self, r: int) -> _RankState:
        assert self.topo is not None
        st = _RankState(r)
        rdir = self.root / rank_dir_name(r)
        if not rdir.is_dir():
            st.problems.append(f"{rank_dir_name(r)}/ missing")
            return st
        if not (rdir / READY_NAME).is_file():
            st.problems.append(f"{rank_dir_name(r)}/{READY_NAME} missing: the reshard of this rank did not finish")
        try:
            m, _ = load_json(rdir / MANIFEST_NAME, PreflightError)
        except PreflightError as e:
            st.problems.append(str(e))
            return st
        if not isinstance(m, dict) or not isinstance(m.get("files"), dict) or not isinstance(m.get("tensors"), dict):
            st.problems.append(f"{rdir / MANIFEST_NAME}: not a rank manifest (no files/tensors)")
            return st
        info = self.topo.rank_info(r)
        want = {"rank": r, "ep_rank": info.ep_rank, "tp_rank": info.tp_rank, "moe_tp_rank": info.moe_tp_rank}
        wrong = [f"{k} {m.get(k)} (topology says {v})" for k, v in want.items() if m.get(k) != v]
        if wrong:
            st.problems.append(f"{MANIFEST_NAME} has " + ", ".join(wrong))
        src_digest = (self.tj.get("source") or {}).get("index_sha256")
        if src_digest and m.get("source_index_sha256") not in (None, src_digest):
            st.problems.append(f"{MANIFEST_NAME} comes from another source (index sha256 "
                               f"{str(m.get('source_index_sha256'))[:12]}..., topology.json has {src_digest[:12]}...)")
        self._files(st, rdir, m["files"])
        st.quant = quant_counts(list(m["tensors"]),
                                [t.get("dtype", "") if isinstance(t, dict) else "" for t in m["tensors"].values()])
        self._experts(st, m["tensors"], info.experts)
        return st

    def _files(self, st: _RankState, rdir: Path, files: dict[str, Any]) -> None:
        for name, entry in sorted(files.items()):
            rel = f"{rdir.name}/{name}"
            size = entry.get("size") if isinstance(entry, dict) else None
            if not isinstance(size, int) or "/" in name or name.startswith("."):
                st.problems.append(f"{MANIFEST_NAME}: bad entry for file {name!r}")
                continue
            st.files[rel] = size
            if isinstance(entry.get("sha256"), str):
                st.digests[rel] = entry["sha256"]
            try:
                got = (rdir / name).stat().st_size
            except FileNotFoundError:
                st.problems.append(f"{name} missing")
                continue
            if got != size:
                what = "truncated" if got < size else "longer than written"
                st.problems.append(f"{name}: {got:,} bytes, manifest says {size:,} ({what})")
        extra = sorted(p.name for p in rdir.glob("*.safetensors") if p.name not in files)
        if extra:
            st.warnings.append(f"{len(extra)} safetensors file(s) not in the manifest (a loader that globs "
                               f"*.safetensors would read them): {', '.join(extra[:3])}")

    def _experts(self, st: _RankState, tensors: dict[str, Any], want: tuple[int, ...]) -> None:
        """The rank holds exactly the experts ``topology.json`` places on its ep_rank."""
        held: set[int] = set()
        for name, t in tensors.items():
            role = classify(name)
            if role.kind != Kind.ROUTED_EXPERT:
                continue
            if role.expert is not None:
                held.add(role.expert)
            elif isinstance(t, dict) and isinstance(t.get("split"), dict) and "experts" in t["split"]:
                held.update(t["split"]["experts"])  # a stacked tensor's slice names its experts
            elif isinstance(t, dict) and t.get("split") is None:
                held.update(want)  # a whole stacked tensor: every expert (ep 1)
        if held and held != set(want):
            missing, extra = sorted(set(want) - held), sorted(held - set(want))
            parts = ([f"lacks experts {format_ranges(missing)}"] if missing else []) + (
                [f"holds experts {format_ranges(extra)} of other ranks"] if extra else [])
            st.problems.append(f"{MANIFEST_NAME} " + " and ".join(parts) + f" (topology places {format_ranges(list(want))})")

    def _compare_digests(self, states: list[_RankState]) -> None:
        # files with a wrong size already have their problem; hashing them would say it twice
        todo = {rel: st for st in states for rel in st.digests if _size_of(self.root / rel) == st.files[rel]}
        digests, errors = hash_files(self.root, sorted(todo), jobs=self.ask.jobs)
        for rel, err in sorted(errors.items()):
            todo[rel].problems.append(f"{rel.split('/', 1)[1]}: cannot read ({err.strerror or err})")
        for rel, d in sorted(digests.items()):
            st = todo[rel]
            if d.sha256 != st.digests[rel]:
                st.content_bad = True
                st.problems.append(f"{rel.split('/', 1)[1]}: sha256 {d.sha256[:12]}..., manifest says "
                                   f"{st.digests[rel][:12]}... (corrupted)")

    def _rank_row(self, st: _RankState) -> Check:
        name = f"rank {st.rank}"
        details = {"files": len(st.files), "bytes": st.weight_bytes}
        if st.problems:
            more = f" (+{len(st.problems) - 1} more)" if len(st.problems) > 1 else ""
            return Check(name, FAIL, st.problems[0] + more, fix=self._fix(self.topo, [st.rank], force=st.content_bad),
                         details={**details, "problems": st.problems})
        how = "sha256" if self.ask.full else "sizes"
        reason = f"READY, {len(st.files)} file(s), {human_bytes(st.weight_bytes)}, {how} match the manifest"
        if st.warnings:
            return Check(name, WARN, st.warnings[0], details={**details, "warnings": st.warnings})
        return Check(name, PASS, reason, details=details)

    # -- capacity and provenance ------------------------------------------------------------------

    def _capacity(self, states: list[_RankState]) -> list[Check]:
        present = [s.weight_bytes for s in states if s.files]
        # a rank still to be written costs about what its siblings cost (ranks differ by an expert at most)
        estimate = max(present) if present else self._any_rank_bytes()
        need = {s.rank: (s.weight_bytes if s.files else estimate) for s in states}
        to_write = sum(need[s.rank] or 0 for s in states if s.problems)  # a broken rank is rewritten whole
        largest_file = max((sz for s in states for sz in s.files.values()), default=0)
        return [
            disk_check(self.root, self.ask.min_free_disk, to_write, self.ask.environ),
            memory_check(largest_file, len(states), self.ask.environ),
            *gpu_checks(need, self._device_slots(states), self.ask.kv_budget, self.ask.environ,
                        mxfp4=any(s.quant and s.quant[0] for s in states)),
        ]

    def _device_slots(self, states: list[_RankState]) -> dict[int, int]:
        return device_slots([s.rank for s in states], self.ask.per_node, self.ask.env)

    def _any_rank_bytes(self) -> int | None:
        """Weight bytes of any complete rank in the directory (another node's, say)."""
        for rdir in sorted(self.root.glob("rank-[0-9]*")):
            try:
                m = json.loads((rdir / MANIFEST_NAME).read_text())
                return sum(int(f["size"]) for f in m["files"].values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
        return None

    def _provenance(self, states: list[_RankState]) -> list[Check]:
        cfg = _config_or_none(self.root)
        counted = [s.quant for s in states if s.quant is not None]
        out = [quant_check(cfg, sum(q[0] for q in counted), sum(q[1] for q in counted))] if counted else []
        src = self.tj.get("source") if isinstance(self.tj.get("source"), dict) else {}
        out += _provenance_files(self.root, src, None)
        return out


def _size_of(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


_FP8_DTYPES = ("F8_E4M3", "F8_E5M2")


def _is_mxfp4_data(part: str, dtype: str) -> bool:
    """The packed E2M1 data of an MXFP4 weight (K3 ``weight_packed``, gpt-oss ``_blocks``);
    counted as summary's ``quant_tensors`` counts them, one per weight."""
    return part in ("weight_packed", "blocks") and is_mxfp4(dtype, "weight_packed")


def quant_counts(names: list[str], dtypes: list[str]) -> tuple[int, int]:
    """``(MXFP4 weights, FP8 tensors)`` among a rank manifest's tensors."""
    mx = sum(1 for n, d in zip(names, dtypes)
             if _is_mxfp4_data("blocks" if n.endswith("_blocks") else n.rsplit(".", 1)[-1], d))
    return mx, sum(1 for d in dtypes if d in _FP8_DTYPES)


def _checkpoint_quant_counts(ckpt: Checkpoint) -> tuple[int, int]:
    """:func:`quant_counts` from the per-signature statistics (no per-tensor loop)."""
    mx = fp8 = 0
    for (_layer, _kind, part, _proj, dtype, _shape, _nbytes), n in ckpt.stats.signatures.items():
        mx += n if _is_mxfp4_data(part, dtype) else 0
        fp8 += n if dtype in _FP8_DTYPES else 0
    return mx, fp8


def _describe(topo: Topology) -> str:
    return (f"ep {topo.ep} x tp {topo.tp}, world size {topo.world_size} (moe_tp {topo.moe_tp}), "
            f"{topo.num_experts} experts {topo.placement}")


def reshard_command(src: str | None, out: Path, topo: Topology | None, ranks: list[int], *, force: bool) -> str:
    """The ``k3ckpt reshard`` invocation that (re)writes ``ranks`` of ``topo`` into ``out``.
    ``SRC`` stands for the source checkpoint when its path is unknown."""
    args = ["k3ckpt", "reshard", src or "SRC", "-o", str(out)]
    if topo is None:
        args += ["--ep", "E", "--tp", "T"]
    else:
        args += ["--ep", str(topo.ep), "--tp", str(topo.tp)]
        if topo.world_size != max(topo.ep, topo.tp):
            args += ["--world-size", str(topo.world_size)]
        if topo.placement != "linear":
            args += ["--placement", topo.placement]
        if ranks and len(ranks) < topo.world_size:
            args += ["--ranks", format_ranges(ranks)]
    if force:
        args.append("--force")
    placeholders = {"SRC", "E", "T"}
    return " ".join(a if a in placeholders else shlex.quote(a) for a in args)


# ---------------------------------------------------------------------------------------------
# Plain checkpoint (a full download or an hf-node copy)


class _PlainCheckpoint:
    def __init__(self, root: Path, ask: _Request) -> None:
        self.root = root
        self.ask = ask
        self.checks: list[Check] = []

    def run(self) -> PreflightReport:
        ask = self.ask
        try:
            ckpt = open_checkpoint(self.root, jobs=ask.jobs, strict=False)
        except CheckpointNotFoundError as e:
            raise PreflightError(f"{self.root}: neither a rank layout (no {TOPOLOGY_NAME}) nor a checkpoint ({e})") from None
        topo = self._topology(ckpt)
        ranks: list[int]
        if topo is None:
            if ask.rank is not None or ask.selection.node is not None:
                raise PreflightError("--rank/--node need --ep/--tp for a plain checkpoint (it has no topology.json)")
            ranks, how = [], "none: no --ep/--tp, every expert is needed"
        else:
            ranks, how = ask.select(topo.world_size)
        self.checks.append(ask.check_environment(topo.world_size if topo else None, ranks))
        self.checks.append(self._structure(ckpt))
        self.checks.append(self._coverage(ckpt, topo, ranks))
        need = self._rank_bytes(ckpt, topo, ranks)
        largest_file = max((h.file_size for h in ckpt.shards.values()), default=0)
        mx, fp8 = _checkpoint_quant_counts(ckpt)
        self.checks.append(disk_check(self.root, ask.min_free_disk, 0, ask.environ))
        self.checks.append(memory_check(largest_file, max(len(ranks), 1), ask.environ))
        slots = device_slots(ranks, ask.per_node, ask.env)
        self.checks += gpu_checks(need, slots, ask.kv_budget, ask.environ, mxfp4=mx > 0)
        self.checks.append(quant_check(ckpt.config, mx, fp8))
        self.checks += _provenance_files(self.root, {"repo": ckpt.source.repo, "revision": ckpt.source.revision},
                                         ckpt)
        # every shard holds some dense tensor of every rank, so the node reads all of them
        return PreflightReport(str(self.root), "checkpoint", _topology_json(topo), ranks, how, self.checks,
                               load_files=[ckpt.path_of(f) for f in sorted(ckpt.shards)],
                               node_bytes=sum(v or 0 for v in need.values()) if need else ckpt.total_bytes)

    def _topology(self, ckpt: Checkpoint) -> Topology | None:
        ask = self.ask
        if not ask.selection.names_topology:
            return None
        cfg = ckpt.config
        found = max((e for _, e in ckpt.stats.expert_parts), default=-1) + 1
        num_experts = (cfg.num_experts if cfg and cfg.num_experts else 0) or found or 1
        return ask.selection.topology(num_experts)

    def _structure(self, ckpt: Checkpoint) -> Check:
        from ..integrity.verify import scale_spans, scan_files, structure_issues

        issues = [i for i in structure_issues(ckpt, None) if MISSING_EXPERTS not in i.message]
        scanned = ""
        if self.ask.full:
            spans = scale_spans(ckpt)
            for f, flagged in sorted(scan_files(ckpt.root, sorted(spans), spans, self.ask.jobs).items()):
                if isinstance(flagged, OSError):
                    issues.append(_issue("unreadable", f, str(flagged.strerror)))
                else:
                    issues += [_issue("nan-scale", f, "E8M0 scale byte 0xFF (NaN)", n) for n in flagged]
            scanned = "; E8M0 scales scanned for NaN"
        n = f"{len(ckpt.shards)} shard(s), {len(ckpt.tensors):,} tensors"
        if not issues:
            return Check("structure", PASS, f"{n}: headers, index and config agree{scanned} (no per-file digests "
                                            f"to compare: use k3ckpt verify --manifest for sha256)")
        missing = sorted(i.file for i in issues if i.kind == "missing-file" and i.file)
        fix = fetch_command(ckpt, self.root, missing) if missing else None
        first = str(issues[0])
        more = f" (+{len(issues) - 1} more)" if len(issues) > 1 else ""
        return Check("structure", FAIL, first + more, fix=fix, details={"issues": [str(i) for i in issues]})

    def _coverage(self, ckpt: Checkpoint, topo: Topology | None, ranks: list[int]) -> Check:
        cfg = ckpt.config
        if cfg is None or not cfg.moe_layers:
            return Check("experts", PASS, "no MoE layers in config.json: no routed experts to cover")
        needed = sorted({e for r in ranks for e in topo.rank_info(r).experts}) if topo else list(range(cfg.num_experts))
        present: dict[int, set[int]] = {}
        for layer, expert in ckpt.stats.expert_parts:
            present.setdefault(layer, set()).add(expert)
        stacked = {sig[0] for sig in ckpt.stats.signatures if sig[1] == Kind.ROUTED_EXPERT and sig[0] not in present}
        gaps = []
        for layer in cfg.moe_layers:
            if layer in stacked:
                continue  # all experts in one tensor: structure checks its shape
            lacking = sorted(set(needed) - present.get(layer, set()))
            if lacking:
                gaps.append((layer, lacking))
        who = f"ranks {format_ranges(ranks)}" if topo else "a full load"
        if not gaps:
            return Check("experts", PASS, f"the {len(needed)} experts {who} needs are in each of "
                                          f"{len(cfg.moe_layers)} MoE layers", details={"needed": format_ranges(needed)})
        layer, lacking = gaps[0]
        more = f" (+{len(gaps) - 1} more layer(s))" if len(gaps) > 1 else ""
        return Check("experts", FAIL, f"layer {layer} lacks {len(lacking)} expert(s) that {who} needs: "
                                      f"{format_ranges(lacking)}{more}",
                     fix=self._coverage_fix(ckpt, topo, ranks),
                     details={"missing": {str(lay): format_ranges(e) for lay, e in gaps}})

    def _coverage_fix(self, ckpt: Checkpoint, topo: Topology | None, ranks: list[int]) -> str:
        """A rank-aware fetch's directory is fixed by fetching these ranks' share into it; any other
        copy (a full checkpoint missing shards, an hf-node directory) by fetching the checkpoint:
        a rank-aware fetch refuses to turn a whole checkpoint into subsets."""
        from ..format.layout import PARTIAL_MARKER

        if (self.root / PARTIAL_MARKER).is_file():
            return fetch_command(ckpt, self.root, [], topo, ranks)
        return fetch_command(ckpt, self.root, [])

    def _rank_bytes(self, ckpt: Checkpoint, topo: Topology | None, ranks: list[int]) -> dict[int, int | None] | None:
        if topo is None:
            return None
        try:
            per_rank = tensors_for_ranks(ckpt, topo, ranks)
        except TopologyError as e:
            self.checks.append(Check("topology", FAIL, str(e)))
            return None
        return {r: rt.total_bytes for r, rt in per_rank.items()}


def _issue(kind: str, file: str, message: str, tensor: str | None = None) -> Any:
    from ..integrity.verify import Issue

    return Issue(kind, file, message, tensor=tensor)


def _topology_json(topo: Topology | None) -> dict[str, Any] | None:
    return None if topo is None else {k: v for k, v in topo.to_json().items() if k != "experts_by_rank"}


def fetch_command(ckpt: Checkpoint, dest: Path, files: list[str], topo: Topology | None = None,
                  ranks: list[int] | None = None) -> str:
    """The ``k3ckpt fetch`` that restores ``files`` (every file when empty) of ``ckpt`` into
    ``dest`` - with ``topo`` and ``ranks``, the rank-aware fetch of just those ranks' tensors;
    ``REPO`` stands for the repository when the layout does not say."""
    args = ["k3ckpt", "fetch", "--source", ckpt.source.hub or "hf", "--repo", ckpt.source.repo or "REPO"]
    if ckpt.source.revision:
        args += ["--revision", ckpt.source.revision]
    args += ["--dest", str(dest)]
    if topo is not None and ranks:
        args += ["--ep", str(topo.ep), "--tp", str(topo.tp), "--world-size", str(topo.world_size),
                 "--placement", topo.placement, "--ranks", format_ranges(ranks)]
    for f in files:
        args += ["--include", f]
    return " ".join(a if a == "REPO" else shlex.quote(a) for a in args)


# ---------------------------------------------------------------------------------------------
# Capacity


def disk_check(root: Path, min_free: int, still_to_write: int, environ: Mapping[str, str]) -> Check:
    """Free space on the filesystem of ``root``: ``min_free`` plus what incomplete ranks need."""
    free = K3CKPT_PREFLIGHT_FREE_BYTES.get(environ)  # the hooks live where the launcher variables do
    hooked = free is not None
    if free is None:
        st = os.statvfs(root)
        free = st.f_bavail * st.f_frsize
    need = min_free + still_to_write
    what = f"{human_bytes(min_free)} to keep free" + (
        f" + {human_bytes(still_to_write)} for ranks still to be written" if still_to_write else "")
    via = f" ({FREE_BYTES_HOOK})" if hooked else ""
    details = {"free_bytes": free, "need_bytes": need}
    if free < need:
        return Check("disk", FAIL, f"{human_bytes(free)} free{via} on {root}, need {human_bytes(need)} ({what})",
                     fix=f"free {human_bytes(need - free)} on the filesystem of {root}", details=details)
    return Check("disk", PASS, f"{human_bytes(free)} free{via}, need {human_bytes(need)} ({what})", details=details)


def _mem_available(environ: Mapping[str, str]) -> tuple[int | None, str]:
    hooked = K3CKPT_PREFLIGHT_MEM_BYTES.get(environ)
    if hooked is not None:
        return hooked, f" ({MEM_BYTES_HOOK})"
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, ""
    except (OSError, ValueError, IndexError):
        pass
    return None, ""


def memory_check(largest_file: int, local_ranks: int, environ: Mapping[str, str]) -> Check:
    """Host RAM: each local rank's loader may stage one whole weight file at a time."""
    avail, via = _mem_available(environ)
    need = largest_file * local_ranks
    if avail is None:
        return Check("host memory", WARN, "not checked: /proc/meminfo has no MemAvailable")
    rule = f"{local_ranks} rank(s) x largest file {human_bytes(largest_file)}"
    details = {"available_bytes": avail, "need_bytes": need}
    if avail < need:
        return Check("host memory", WARN, f"{human_bytes(avail)} available{via}, loaders may stage "
                                          f"{human_bytes(need)} ({rule}): expect swapping or the OOM killer",
                     details=details)
    return Check("host memory", PASS, f"{human_bytes(avail)} available{via}, need {human_bytes(need)} ({rule})",
                 details=details)


def query_gpus(environ: Mapping[str, str]) -> tuple[str | None, list[GpuDevice] | str]:
    """``(tool, devices)`` from ``nvidia-smi`` or ``rocm-smi`` on ``environ['PATH']``;
    ``(None, why)`` when neither is there, ``(tool, why)`` when it failed."""
    path = environ.get("PATH", os.defpath)
    for tool, args, parse in (
        ("nvidia-smi", ["--query-gpu=name,memory.total,memory.used", "--format=csv,noheader,nounits"], _parse_nvidia),
        ("rocm-smi", ["--showproductname", "--showmeminfo", "vram", "--json"], _parse_rocm),
    ):
        exe = shutil.which(tool, path=path)
        if exe is None:
            continue
        try:
            res = subprocess.run([exe, *args], capture_output=True, text=True, timeout=GPU_QUERY_TIMEOUT,
                                 env=dict(environ))
        except subprocess.TimeoutExpired:
            return tool, f"{tool} did not answer within {GPU_QUERY_TIMEOUT:.0f} s"
        except OSError as e:
            return tool, f"{tool} could not run ({e.strerror or e})"
        if res.returncode != 0:
            last = (res.stderr or res.stdout).strip().splitlines()
            return tool, f"{tool} exited {res.returncode}" + (f": {last[-1]}" if last else "")
        try:
            devices = parse(res.stdout)
        except (ValueError, KeyError, TypeError) as e:
            return tool, f"{tool}: unexpected output ({e})"
        return tool, _visible(devices, environ, tool)
    return None, "neither nvidia-smi nor rocm-smi is on PATH"


def _parse_nvidia(out: str) -> list[GpuDevice]:
    devices = []
    for i, line in enumerate(x for x in out.splitlines() if x.strip()):
        name, total, used = (p.strip() for p in line.rsplit(",", 2))
        devices.append(GpuDevice(i, name, int(float(total)) * 1024**2, int(float(used)) * 1024**2))
    if not devices:
        raise ValueError("no GPUs listed")
    return devices


def _parse_rocm(out: str) -> list[GpuDevice]:
    data = json.loads(out)
    devices = []
    for i, (card, info) in enumerate(sorted((k, v) for k, v in data.items() if k.startswith("card"))):
        name = next((info[k] for k in ("Card Series", "Card series", "Card model", "Card SKU") if info.get(k)), card)
        total = int(next(v for k, v in info.items() if "Total Memory (B)" in k))
        used = int(next(v for k, v in info.items() if "Total Used Memory (B)" in k))
        devices.append(GpuDevice(i, str(name), total, used))
    if not devices:
        raise ValueError("no GPUs listed")
    return devices


def _visible(devices: list[GpuDevice], environ: Mapping[str, str], tool: str) -> list[GpuDevice]:
    """The devices the engine will see: ``CUDA_VISIBLE_DEVICES`` (``HIP_``/``ROCR_`` on AMD)
    by index, renumbered from 0 as the runtime does."""
    var = ("CUDA_VISIBLE_DEVICES",) if tool == "nvidia-smi" else ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
    for v in var:
        raw = environ.get(v)
        if raw is None or raw.strip() == "":
            continue
        items = [x.strip() for x in raw.split(",")]
        if not all(x.isdigit() for x in items):
            return devices  # UUIDs: keep the tool's order
        picked = [devices[int(x)] for x in items if int(x) < len(devices)]
        return [GpuDevice(i, d.name, d.total, d.used) for i, d in enumerate(picked)]
    return devices


def device_slots(ranks: list[int], per_node: int | None, env: RankEnv) -> dict[int, int]:
    """Which local device each rank runs on: its local rank (``rank % per_node``), the launcher's
    ``LOCAL_RANK`` for a single rank, else its position in the node's list."""
    if len(ranks) == 1 and env.local_rank is not None:
        return {ranks[0]: env.local_rank}
    if per_node:
        return {r: r % per_node for r in ranks}
    return {r: i for i, r in enumerate(ranks)}


def mxfp4_support(gpu_name: str) -> str | None:
    """``native``, ``weight-only`` or ``None`` (unknown) for a GPU's product name."""
    up = gpu_name.upper().replace(" ", "")
    if any(k in up for k in MXFP4_NATIVE):
        return "native"
    if any(k in up for k in MXFP4_WEIGHT_ONLY):
        return "weight-only"
    return None


def gpu_checks(need: Mapping[int, int | None] | None, slots: Mapping[int, int], kv_budget: int,
               environ: Mapping[str, str], *, mxfp4: bool) -> list[Check]:
    """GPU memory per local rank (weights x 1.15 + KV budget <= free), then the MXFP4 note.
    ``need``: rank -> weight bytes (``None`` for a rank not yet written); ``None`` when no
    topology says what a GPU loads."""
    tool, devices = query_gpus(environ)
    if isinstance(devices, str):
        what = "GPU memory and MXFP4 support" if mxfp4 else "GPU memory"
        return [Check("gpu", WARN, f"{what} not checked: {devices}")]
    out = []
    short, unknown = [], []
    for r, weights in sorted((need or {}).items()):
        slot = slots.get(r, 0)
        if slot >= len(devices):
            short.append(f"rank {r} needs device {slot} but {tool} shows {len(devices)}")
            continue
        if weights is None:
            unknown.append(r)
            continue
        want = int(weights * WEIGHT_OVERHEAD) + kv_budget
        d = devices[slot]
        if want > d.free:
            short.append(f"rank {r} needs {human_bytes(want)} ({human_bytes(weights)} x {WEIGHT_OVERHEAD} + "
                         f"{human_bytes(kv_budget)} KV) but GPU {slot} ({d.name}) has {human_bytes(d.free)} free")
    names = sorted({d.name for d in devices})
    seen = f"{len(devices)} x {' / '.join(names)} ({tool})"
    details = {"devices": [d.__dict__ | {"free": d.free} for d in devices], "kv_budget": kv_budget}
    if short:
        more = f" (+{len(short) - 1} more)" if len(short) > 1 else ""
        out.append(Check("gpu", FAIL, short[0] + more, details={**details, "problems": short}))
    elif unknown:
        out.append(Check("gpu", WARN, f"{seen}; weights of ranks {format_ranges(unknown)} unknown (no manifest yet)",
                         details=details))
    elif need:
        biggest = max(w for w in need.values() if w is not None)
        out.append(Check("gpu", PASS, f"{seen}: every rank fits (largest: {human_bytes(biggest)} x "
                                      f"{WEIGHT_OVERHEAD} + {human_bytes(kv_budget)} KV)", details=details))
    else:
        out.append(Check("gpu", WARN, f"{seen}; not compared: give --ep/--tp so preflight knows what each GPU "
                                      f"loads", details=details))
    if mxfp4:
        out.append(_mxfp4_row(names))
    return out


def _mxfp4_row(names: list[str]) -> Check:
    kinds = {n: mxfp4_support(n) for n in names}
    if all(k == "native" for k in kinds.values()):
        return Check("mxfp4", PASS, f"MXFP4 runs natively on {', '.join(names)}")
    if all(k in ("native", "weight-only") for k in kinds.values()):
        slow = [n for n, k in kinds.items() if k == "weight-only"]
        return Check("mxfp4", PASS, f"weight-only MXFP4 on {', '.join(slow)} (Hopper has no FP4: weights stay "
                                    f"MXFP4 in memory and are upcast in-kernel, W4A16)")
    odd = [n for n, k in kinds.items() if k is None]
    return Check("mxfp4", WARN, f"no known MXFP4 support on {', '.join(odd)}: check that the engine has a "
                                f"weight-only MXFP4 kernel for it")


# ---------------------------------------------------------------------------------------------
# Provenance


def license_kind(text: str) -> tuple[str, str]:
    """``(kind, status)`` of a license by its content. K3's "Modified MIT" is not plain MIT: it
    adds an attribution condition for large deployments."""
    head = " ".join(text.split()).lower()
    if "modified mit" in head:
        return "Modified MIT (not plain MIT: adds a display/attribution condition for large deployments)", PASS
    if "apache license" in head and "version 2.0" in head:
        return "Apache-2.0", PASS
    if "mit license" in head or "permission is hereby granted, free of charge" in head:
        return "MIT", PASS
    return "unrecognized license text (read it)", WARN


def _provenance_files(root: Path, source: dict[str, Any] | None, ckpt: Checkpoint | None) -> list[Check]:
    out = []
    lic = next((root / n for n in LICENSE_NAMES if (root / n).is_file()), None)
    if lic is None:
        out.append(Check("license", WARN, f"no LICENSE in {root}: the weights must be redistributed with their "
                                          f"license", fix=fetch_command(ckpt, root, ["LICENSE"]) if ckpt else None))
    else:
        try:
            kind, status = license_kind(lic.read_text(errors="replace")[:20000])
        except OSError as e:
            kind, status = f"unreadable ({e.strerror})", WARN
        out.append(Check("license", status, f"{lic.name}: {kind}"))
    src = source or {}
    repo, rev = src.get("repo"), src.get("revision")
    digest = src.get("index_sha256")
    if rev:
        where = f"{repo}@{rev}" if repo else f"revision {rev}"
        extra = f", index sha256 {digest[:12]}..." if digest else ""
        out.append(Check("source", PASS, f"from {where}{extra}"))
    elif source is None:
        out.append(Check("source", WARN, "not recorded: no usable topology.json"))
    else:
        extra = f" (only the index sha256 {digest[:12]}... is recorded)" if digest else ""
        out.append(Check("source", WARN, f"source revision not recorded: the checkpoint did not come from a "
                                         f"hub download k3ckpt could identify{extra}"))
    return out


def _config_or_none(root: Path) -> ModelConfig | None:
    try:
        return load_config(root / "config.json")
    except ConfigError:
        return None


def quant_check(cfg: ModelConfig | None, mx: int, fp8: int) -> Check:
    """The quantization format ``config.json`` declares against the ``mx`` MXFP4 weights and
    ``fp8`` FP8 tensors present."""
    if cfg is None:
        return Check("quantization", WARN, "no readable config.json: the quantization format was not checked")
    declared = cfg.quant_format
    found = f"{mx:,} MXFP4 weights" if mx else (f"{fp8:,} FP8 tensors" if fp8 else "no quantized tensors")
    says = declared or "no quantization_config"
    ok = ((mx > 0) == bool(declared and "mxfp4" in declared)
          and (not (declared or "").startswith("fp8") or fp8 > 0))
    if not ok:
        return Check("quantization", FAIL, f"config.json says {says} but the tensors have {found}",
                     details={"declared": declared, "mxfp4_tensors": mx, "fp8_tensors": fp8})
    return Check("quantization", PASS, f"config.json says {says}; {found}",
                 details={"declared": declared, "mxfp4_tensors": mx, "fp8_tensors": fp8})


# ---------------------------------------------------------------------------------------------
# Read speed


def measure_read_speed(files: list[Path], seconds: float, *, readers: int = 4) -> ReadSpeed:
    """Read ``files`` for at most ``seconds`` with ``readers`` threads, bypassing the page cache
    with O_DIRECT where the filesystem allows it. Where it does not (tmpfs answers EINVAL),
    the file is read buffered after ``POSIX_FADV_DONTNEED`` dropped its cached pages - which a
    RAM-backed filesystem cannot honour, so :attr:`ReadSpeed.note` says so.

    Raises:
        OSError: a file cannot be opened or read (an I/O error is a finding, not a speed).
    """
    queue = list(reversed(files))
    lock = threading.Lock()
    total = [0]
    fellback: list[str] = []
    errors: list[OSError] = []
    deadline = time.monotonic() + seconds

    def worker() -> None:
        buf = mmap.mmap(-1, IO_BUFFER)  # page-aligned, as O_DIRECT requires
        try:
            while time.monotonic() < deadline:
                with lock:
                    if not queue or errors:
                        return
                    f = queue.pop()
                n, direct = _read_file(f, buf, deadline)
                with lock:
                    total[0] += n
                    if not direct:
                        fellback.append(f.name)
        except OSError as e:
            if not e.filename:
                e.filename = str(f)
            with lock:
                errors.append(e)
        finally:
            buf.close()

    n_threads = max(1, min(readers, len(files)))
    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, name=f"io-test-{i}") for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    if errors:
        raise errors[0]
    note = ""
    if fellback:
        note = (f"O_DIRECT refused for {len(fellback)} file(s) (tmpfs before Linux 6.6, some FUSE and network "
                f"filesystems): read buffered after "
                f"POSIX_FADV_DONTNEED; a RAM-backed filesystem keeps its pages, so this is memory speed")
    return ReadSpeed(total[0], elapsed, n_threads, not fellback, len(files), note)


def _read_file(path: Path, buf: mmap.mmap, deadline: float) -> tuple[int, bool]:
    """Bytes read from ``path`` until its end or ``deadline``, and whether O_DIRECT held."""
    direct = hasattr(os, "O_DIRECT")
    fd = -1
    if direct:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            direct = False
    if not direct:
        fd = _open_uncached(path)
    pos = 0
    try:
        while time.monotonic() < deadline:
            try:
                n = os.preadv(fd, [buf], pos)
            except OSError as e:
                if not (direct and e.errno == errno.EINVAL):
                    raise
                os.close(fd)  # the filesystem accepted O_DIRECT at open but not for reads
                fd, direct = _open_uncached(path), False
                continue
            if n == 0:
                break
            pos += n
    finally:
        os.close(fd)
    return pos, direct


def _open_uncached(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return fd


def _io_check(report: PreflightReport, seconds: float) -> None:
    files, node_bytes = report.load_files, report.node_bytes
    if not files:
        report.checks.append(Check("read speed", WARN, "not measured: no complete weight files to read"))
        return
    try:
        rs = measure_read_speed(files, seconds, readers=max(1, min(len(report.ranks) or 1, 8)))
    except OSError as e:
        report.checks.append(Check("read speed", FAIL, f"{e.filename or ''}: read failed ({e.strerror or e})"))
        return
    report.read_speed = rs
    rate = rs.bytes_per_second
    mode = "O_DIRECT" if rs.direct else "buffered"
    predicted = node_bytes / rate if rate else None
    when = f"; this node's {human_bytes(node_bytes)} would load in ~{_duration(predicted)}" if predicted else ""
    reason = (f"{human_bytes(rate)}/s ({human_bytes(rs.bytes_read)} in {rs.seconds:.1f} s, {mode}, "
              f"{rs.readers} reader(s)){when}")
    status = PASS if rs.direct else WARN
    report.checks.append(Check("read speed", status, reason + (f"; {rs.note}" if rs.note else ""),
                               details={**rs.to_json(), "node_bytes": node_bytes,
                                        "predicted_load_seconds": round(predicted, 1) if predicted else None}))


def _duration(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


# ---------------------------------------------------------------------------------------------
# Text output


def render_preflight(rep: PreflightReport) -> str:
    """The table: one row per check, and under each FAIL (or WARN with one) its fix."""
    t = rep.topology
    what = "rank layout" if rep.layout == "rank-layout" else "checkpoint"
    topo = (f", ep {t['ep']} x tp {t['tp']}, world size {t['world_size']}" if t else "")
    ranks = f"ranks {format_ranges(rep.ranks)} ({rep.selection})" if rep.ranks else rep.selection
    lines = [f"preflight  {rep.path}", f"layout     {what}{topo}; {ranks}", ""]
    width = max((len(c.name) for c in rep.checks), default=8)
    for c in rep.checks:
        lines.append(f"{c.status:<4}  {c.name:<{width}}  {c.reason}")
        if c.fix and c.status != PASS:
            lines.append(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
    n = rep.counts()
    if rep.fix_all:
        lines += ["", f"fix all    {rep.fix_all}"]
    lines += ["", f"result     {n[FAIL]} FAIL, {n[WARN]} WARN, {n[PASS]} PASS: "
                  + ("ready to load" if rep.ok else "not ready")]
    return "\n".join(lines)
