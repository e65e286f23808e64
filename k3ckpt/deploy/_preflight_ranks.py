"""Preflight's view of the directory: which ranks are this node's (and whether the launcher
agrees), and the checks of a per-rank layout or of a plain checkpoint."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import CheckpointNotFoundError, PreflightError, SafetensorsHeaderError
from ..format.checkpoint import Checkpoint, open_checkpoint
from ..format.filedigest import SEGMENTS_KEY, recorded_digest
from ..format.header import read_header
from ..format.inspect import MISSING_EXPERTS
from ..format.layout import (
    FORMAT,
    MANIFEST_NAME,
    READY_NAME,
    TOPOLOGY_NAME,
    rank_dir_name,
)
from ..format.loadable import CONFIG_NAME, config_findings
from ..format.roles import Kind, classify
from ..format.topology import (
    RankEnv,
    RankSelection,
    Topology,
    TopologyError,
    is_mxfp4,
    parse_ranks,
    rank_from_env,
    ranks_of_node,
    tensors_for_ranks,
)
from ..integrity.hashing import FileDigest, HashError, Progress, Span, hash_files
from ..integrity.segments import read_prefix, segments_of
from ..utils import format_ranges, human_bytes, load_json
from ._preflight_host import (
    device_slots,
    disk_check,
    gpu_checks,
    memory_check,
    provenance_files,
    quant_check,
)
from ._preflight_report import (
    FAIL,
    PASS,
    WARN,
    Check,
    PreflightReport,
    copy_command,
    describe_topology,
    environment_fix,
    fetch_command,
    new_output_dir,
    preflight_command,
    reshard_command,
    restore_command,
    topology_suffix,
)


@dataclass
class Request:
    selection: RankSelection
    full: bool
    kv_budget: int
    min_free_disk: int
    jobs: int | None
    env: RankEnv
    environ: Mapping[str, str]
    # --full's progress: on_plan(bytes to read), then progress(bytes) as they are read
    progress: Progress | None = None
    on_plan: Callable[[int], None] | None = None

    def plan_bytes(self, total: int) -> None:
        if self.on_plan is not None:
            self.on_plan(total)

    @property
    def per_node(self) -> int | None:
        """Ranks per node: ``--gpus-per-node``, else the launcher's."""
        return self.selection.gpus_per_node or self.env.local_world_size

    @property
    def asks_ranks(self) -> bool:
        """``--ranks`` was given."""
        return self.selection.ranks is not None

    def select(self, world_size: int) -> tuple[list[int], str]:
        """This node's ranks of a world of ``world_size`` and how they were chosen."""
        asked = None if self.selection.ranks is None else ranks_of_spec(self.selection.ranks, world_size)
        return select_ranks(world_size, rank=asked, node=self.selection.node,
                            gpus_per_node=self.selection.gpus_per_node, env=self.env)

    def check_environment(self, world_size: int | None, ranks: list[int]) -> Check:
        """:func:`check_environment` with this request's options."""
        return check_environment(self.env, world_size, ranks, rank=ranks if self.asks_ranks else None,
                                 node=self.selection.node, gpus_per_node=self.selection.gpus_per_node)


def ranks_of_spec(spec: str | Sequence[int], world_size: int) -> list[int]:
    """``--ranks`` as every command reads it (:func:`~k3ckpt.format.topology.parse_ranks`:
    ``3``, ``0-3,8``): sorted, without duplicates, each in ``0..world_size-1``.

    Raises:
        TopologyError: not ranks, or a rank outside the world.
    """
    return parse_ranks(spec if isinstance(spec, str) else ",".join(map(str, spec)), world_size)


# ---------------------------------------------------------------------------------------------
# Which ranks, and does the launcher agree


def select_ranks(
    world_size: int, *, rank: int | Sequence[int] | None, node: int | None, gpus_per_node: int | None, env: RankEnv,
) -> tuple[list[int], str]:
    """This node's ranks and how they were chosen (see the module docstring for the order).
    ``rank``: the ranks ``--ranks`` names (one, or a list).

    Raises:
        TopologyError: ``rank`` or ``node`` is outside the topology (an explicit option; an
            out-of-range launcher variable is reported by the environment check instead).
    """
    if rank is not None:
        asked = ranks_of_spec([rank] if isinstance(rank, int) else rank, world_size)
        return asked, f"--ranks {format_ranges(asked)}"
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
    return list(range(world_size)), "all ranks (no --ranks/--node and no launcher variables)"


#: LeaderWorkerSet's index of this pod (one pod per node; 0 is the leader).
LWS_NODE_VARIABLE = "LWS_WORKER_INDEX"


def launcher_env(environ: Mapping[str, str]) -> RankEnv:
    """:func:`~k3ckpt.format.topology.rank_from_env`, read as a one-process-per-node launch
    when that is what the launcher ran: ``srun --ntasks-per-node=1`` (``SLURM_NTASKS_PER_NODE=1``,
    or as many tasks as nodes) numbers *nodes* in SLURM_PROCID/SLURM_NTASKS, not GPU ranks, so
    those variables give the node index and nothing else; a LeaderWorkerSet pod (one per node)
    gives its node in ``LWS_WORKER_INDEX``."""
    env = rank_from_env(environ)
    if _one_task_per_node(environ):
        slurm = {k for k, v in env.sources.items() if v.startswith("SLURM_")}
        if env.node is None or env.sources.get("node", "").startswith("SLURM_"):
            var = "SLURM_NODEID" if environ.get("SLURM_NODEID", "").strip().isdigit() else "SLURM_PROCID"
            env = _with(env, "node", var, environ)
        for k in slurm - {"node"}:
            env = _with(env, k, None, environ)
    if env.node is None and environ.get(LWS_NODE_VARIABLE, "").strip().isdigit():
        env = _with(env, "node", LWS_NODE_VARIABLE, environ)
    return env


def _one_task_per_node(environ: Mapping[str, str]) -> bool:
    tasks, nodes = environ.get("SLURM_NTASKS", "").strip(), environ.get("SLURM_NNODES", "").strip()
    return environ.get("SLURM_NTASKS_PER_NODE", "").strip() == "1" or (tasks.isdigit() and tasks == nodes)


def _with(env: RankEnv, fld: str, var: str | None, environ: Mapping[str, str]) -> RankEnv:
    """``env`` with field ``fld`` read from ``var`` (None: dropped)."""
    sources = {k: v for k, v in env.sources.items() if k != fld}
    candidates = {k: v for k, v in env.candidates.items() if k != fld}
    value = None
    if var is not None:
        value = int(environ[var].strip())
        sources[fld], candidates[fld] = var, ((var, value),)
    fields: dict[str, Any] = {fld: value, "sources": sources, "candidates": candidates}
    return replace(env, **fields)


def check_environment(env: RankEnv, world_size: int | None, ranks: list[int], *, rank: int | Sequence[int] | None,
                      node: int | None, gpus_per_node: int | None) -> Check:
    """The launcher's variables against the topology, the options (``rank``: the ranks
    ``--ranks`` names) and each other."""
    rank = [rank] if isinstance(rank, int) else (None if rank is None else list(rank))
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
        return Check("environment", FAIL, "; ".join(bad), fix=environment_fix(bad[0]), details={"variables": seen})
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


def _env_vs_options(env: RankEnv, ranks: list[int], rank: list[int] | None, node: int | None,
                    gpus_per_node: int | None) -> list[str]:
    src, bad = env.sources, []
    if env.rank is not None:
        if rank is not None and env.rank not in rank:
            bad.append(f"{src['rank']}={env.rank} but --ranks {format_ranges(rank)}")
        elif rank is None and env.rank not in ranks and (node is not None or env.node is not None):
            bad.append(f"{src['rank']}={env.rank} is not one of this node's ranks {format_ranges(ranks)}")
    if node is not None and env.node is not None and env.node != node:
        bad.append(f"{src['node']}={env.node} but --node {node}")
    if gpus_per_node and env.local_world_size is not None and env.local_world_size != gpus_per_node:
        bad.append(f"{src['local_world_size']}={env.local_world_size} but --gpus-per-node {gpus_per_node}")
    return bad


def _env_vs_node_size(env: RankEnv, rank: list[int] | None, per_node: int) -> list[str]:
    """Local rank and node index must be what the global rank implies with ``per_node`` ranks
    per node (torchrun and srun number ranks node by node)."""
    src, bad = env.sources, []
    me = env.rank if env.rank is not None else (rank[0] if rank is not None and len(rank) == 1 else None)
    if me is not None and env.local_rank is not None and me % per_node != env.local_rank:
        who = f"{src['rank']}={me}" if env.rank is not None else f"--ranks {me}"
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
    # rank-dir/file -> what its manifest records of its bytes: (SEGMENTS_KEY or "sha256", digest)
    digests: dict[str, tuple[str, str]] = field(default_factory=dict)
    tensor_digests: dict[str, str] = field(default_factory=dict)  # tensor -> the sha256 its manifest lists
    quant: tuple[int, int] | None = None  # (MXFP4 weights, FP8 tensors) of its manifest

    @property
    def weight_bytes(self) -> int:
        return sum(self.files.values())


class RankLayout:
    def __init__(self, root: Path, ask: Request) -> None:
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
            self.checks += provenance_files(self.root, None, self._restore)
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
            self.checks.append(Check("topology", FAIL, str(e), fix=self._new_layout_fix(None)))
            return
        if isinstance(tj, dict):
            self.tj = tj  # even an invalid one may name the source the fix needs
        if not isinstance(tj, dict) or tj.get("format") != FORMAT:
            self.checks.append(Check("topology", FAIL, f"{path}: not a {FORMAT} topology.json",
                                     fix=self._new_layout_fix(None)))
            return
        self.tj = tj
        try:
            # Unchecked JSON values on purpose: Topology validates its fields and raises TopologyError.
            topo = Topology(tj.get("ep"), tj.get("tp"), tj.get("world_size"), tj.get("expert_placement"),  # type: ignore[arg-type]
                            tj.get("num_experts"))  # type: ignore[arg-type]
        except TopologyError as e:
            self.checks.append(Check("topology", FAIL, f"{path}: {e}", fix=self._new_layout_fix(None)))
            return
        if tj.get("experts_by_rank") != topo.experts_by_ep_rank():
            self.checks.append(Check("topology", FAIL, f"{path}: experts_by_rank is not the {topo.placement} "
                                     f"placement of {topo.num_experts} experts over ep {topo.ep}",
                                     fix=self._new_layout_fix(topo)))
            return
        self.topo = topo
        desc = describe_topology(topo)
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
        """Reshard this node's ranks for the requested topology into a new directory: the layout
        here is another topology's, which a fix never overwrites (other nodes may load it)."""
        ask = self.ask
        try:
            sel = ask.selection
            want = Topology.make(sel.ep or topo.ep, sel.tp or topo.tp, sel.world_size, sel.placement or topo.placement,
                                 num_experts=topo.num_experts)
            ranks, _ = ask.select(want.world_size)
        except TopologyError:
            return None
        return reshard_command(self._source(), new_output_dir(self.root, topology_suffix(want)), want, ranks,
                               force=False)

    def _new_layout_fix(self, topo: Topology | None) -> str:
        """A layout whose topology.json is unreadable or inconsistent is rewritten into a new
        directory: what is here is not ours to discard (``--force`` would delete its ranks)."""
        suffix = topology_suffix(topo) if topo is not None else "resharded"
        return reshard_command(self._source(), new_output_dir(self.root, suffix), topo, [], force=False)

    def _fix(self, topo: Topology | None, ranks: list[int], *, force: bool) -> str:
        """Rewrite ``ranks`` of the layout's own topology in place (``force``: even where sizes match)."""
        return reshard_command(self._source(), self.root, topo, ranks, force=force)

    def _source(self) -> str | None:
        """The source path ``topology.json`` records."""
        return (self.tj.get("source") or {}).get("path") if isinstance(self.tj.get("source"), dict) else None

    def _restore(self, files: list[str]) -> str:
        """Copy files reshard copies from the source (config, tokenizer, licence) back in."""
        return copy_command(self._source(), files, self.root)

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
        st.tensor_digests = {name: t["sha256"] for name, t in m["tensors"].items()
                             if isinstance(t, dict) and isinstance(t.get("sha256"), str)}
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
            if (recorded := recorded_digest(entry)) is not None:
                st.digests[rel] = recorded
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
        """``--full``: hash every file of the ranks and compare what its manifest records - its
        segments' digest (each tensor's sha256 from one read, then the header's: a mismatch names
        the tensor), or the plain sha256 manifests written before 2026-12-06 record."""
        # files with a wrong size already have their problem; hashing them would say it twice
        todo = {rel: st for st in states for rel in st.digests if _size_of(self.root / rel) == st.files[rel]}
        spans: dict[str, list[Span]] = {}
        starts: dict[str, int] = {}
        for rel in sorted(todo):
            if todo[rel].digests[rel][0] != SEGMENTS_KEY:
                continue
            try:
                header = read_header(self.root / rel, rel)
            except SafetensorsHeaderError as e:
                _corrupted(todo.pop(rel), rel, f"not a safetensors file ({e.problem})")
                continue
            except OSError as e:  # (unreadable: not a verdict on its bytes)
                todo.pop(rel).problems.append(f"{rel.split('/', 1)[1]}: cannot read ({e.strerror or e})")
                continue
            spans[rel] = [Span(name, *header.absolute_range(name)) for name in header.tensors]
            starts[rel] = header.data_start
        self.ask.plan_bytes(sum(todo[rel].files[rel] for rel in todo))
        digests, errors = hash_files(self.root, sorted(todo), jobs=self.ask.jobs, spans=spans,
                                     progress=self.ask.progress, spans_only=spans.__contains__)
        for rel, err in sorted(errors.items()):
            todo[rel].problems.append(f"{rel.split('/', 1)[1]}: cannot read ({err.strerror or err})")
        for rel, d in sorted(digests.items()):
            st = todo[rel]
            kind, want = st.digests[rel]
            if kind != SEGMENTS_KEY:
                if d.sha256 != want:
                    _corrupted(st, rel, f"sha256 {d.sha256[:12]}..., manifest says {want[:12]}...")
                continue
            try:
                got = segments_of(read_prefix(self.root / rel, starts[rel]), spans[rel], d.spans or {})
            except (HashError, OSError, ValueError) as e:
                st.problems.append(f"{rel.split('/', 1)[1]}: cannot read ({e})")
                continue
            if got != want:
                _corrupted(st, rel, _segments_mismatch(spans[rel], d, st.tensor_digests, got, want))

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
        cfg, _ = config_findings(self.root)
        counted = [s.quant for s in states if s.quant is not None]
        out = [quant_check(cfg, sum(q[0] for q in counted), sum(q[1] for q in counted))] if counted else []
        src = self.tj.get("source") if isinstance(self.tj.get("source"), dict) else {}
        out += provenance_files(self.root, src, self._restore)
        return out


def verify_advice(root: Path) -> str:
    """The ``k3ckpt verify`` command that checks this directory's bytes: a share (node directory,
    rank-aware copy) holds rewritten shards, which only a tensor-hash manifest can check."""
    from ..integrity.share import share_marker

    if share_marker(root) is not None:
        return f"no digests checked here: use k3ckpt verify {root} --manifest <tensor-hash manifest> for every tensor's sha256"
    return "no per-file digests to compare: use k3ckpt verify --manifest for sha256"


def _corrupted(st: _RankState, rel: str, what: str) -> None:
    """Record that a file of the rank (``rel``, under the layout's root) holds other bytes than
    its manifest says: a re-run of reshard must overwrite it (``--force``)."""
    st.content_bad = True
    st.problems.append(f"{rel.split('/', 1)[1]}: {what} (corrupted)")


def _segments_mismatch(spans: list[Span], d: FileDigest, listed: dict[str, str], got: str, want: str) -> str:
    """What differs in a file whose segments' digest is not its manifest's: the first tensor
    (in the file's order) whose sha256 is not the one the manifest lists, else the header."""
    found = d.spans or {}
    for s in sorted(spans, key=lambda s: s.start):
        if s.name in found and s.name in listed and found[s.name] != listed[s.name]:
            return f"tensor {s.name!r}: sha256 {found[s.name][:12]}..., manifest says {listed[s.name][:12]}..."
    return f"segments sha256 {got[:12]}..., manifest says {want[:12]}... (the header differs)"


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



# ---------------------------------------------------------------------------------------------
# Plain checkpoint (a full download or an hf-node copy)


class PlainCheckpoint:
    def __init__(self, root: Path, ask: Request) -> None:
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
            if ask.asks_ranks or ask.selection.node is not None:
                raise PreflightError("--ranks/--node need --ep/--tp for a plain checkpoint (it has no topology.json)")
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
        self.checks += provenance_files(ckpt.root, {"repo": ckpt.source.repo, "revision": ckpt.source.revision},
                                        self._restorer(ckpt))
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
        # --tp/--dp mean what plan and reshard make of them, vLLM's expert parallel (ep = tp x dp):
        # an engine loads this directory; an --ep given is taken as given
        return ask.selection.topology(num_experts, engine=ask.selection.ep is None)

    def _structure(self, ckpt: Checkpoint) -> Check:
        from ..integrity.verify import scale_spans, scan_files, structure_issues

        # an unreadable config.json is the config row's FAIL: saying it here too would count it twice
        issues = [i for i in structure_issues(ckpt, None) if MISSING_EXPERTS not in i.message
                  and not (i.kind == "config" and i.file == CONFIG_NAME and ckpt.config is None)]
        scanned = ""
        if self.ask.full:
            spans = scale_spans(ckpt)
            self.ask.plan_bytes(sum(s.stop - s.start for ss in spans.values() for s in ss))
            scanned_files = scan_files(ckpt.root, sorted(spans), spans, self.ask.jobs, progress=self.ask.progress)
            for f, flagged in sorted(scanned_files.items()):
                if isinstance(flagged, OSError):
                    issues.append(_issue("unreadable", f, str(flagged.strerror)))
                else:
                    issues += [_issue("nan-scale", f, "E8M0 scale byte 0xFF (NaN)", n) for n in flagged]
            scanned = "; E8M0 scales scanned for NaN"
        n = f"{len(ckpt.shards)} shard(s), {len(ckpt.tensors):,} tensors"
        agree = "headers, index and config agree" if ckpt.config else \
            f"headers and index agree ({CONFIG_NAME} missing or unreadable: not compared)"
        if not issues:
            return Check("structure", PASS, f"{n}: {agree}{scanned} ({verify_advice(ckpt.root)})")
        first = str(issues[0])
        more = f" (+{len(issues) - 1} more)" if len(issues) > 1 else ""
        return Check("structure", FAIL, first + more, fix=self._structure_fix(ckpt, issues),
                     details={"issues": [str(i) for i in issues]})

    def _structure_fix(self, ckpt: Checkpoint, issues: list[Any]) -> str:
        """Fetch the files the issues name again (a fetch replaces what does not verify and adds
        what is missing); every file when an issue names none."""
        named = {i.file for i in issues if i.file}
        return restore_command(ckpt, ckpt.root, sorted(named) if all(i.file for i in issues) else [])

    def _coverage(self, ckpt: Checkpoint, topo: Topology | None, ranks: list[int]) -> Check:
        cfg = ckpt.config
        if cfg is None:  # which layers hold experts is the config's to say: nothing was checked
            return Check("experts", WARN, f"not checked: {CONFIG_NAME} is missing or unreadable, so which layers "
                                          f"need which experts is unknown")
        if not cfg.moe_layers:
            return Check("experts", PASS, f"no MoE layers in {CONFIG_NAME}: no routed experts to cover")
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

        if (ckpt.root / PARTIAL_MARKER).is_file():
            return fetch_command(ckpt, ckpt.root, [], topo, ranks)
        return restore_command(ckpt, ckpt.root, [])

    def _restorer(self, ckpt: Checkpoint) -> Callable[[list[str]], str | None]:
        """Restores named files of the checkpoint from its hub (``hf download`` in an HF cache)."""
        return lambda files: restore_command(ckpt, ckpt.root, files)

    def _rank_bytes(self, ckpt: Checkpoint, topo: Topology | None, ranks: list[int]) -> dict[int, int | None] | None:
        if topo is None:
            return None
        try:
            per_rank = tensors_for_ranks(ckpt, topo, ranks)
        except TopologyError as e:
            sel, why = self.ask.selection, str(e)
            if topo.ep != topo.world_size and topo.world_size % topo.tp == 0:  # experts cut: vLLM keeps them whole
                whole = Topology.make(topo.world_size, topo.tp, topo.world_size, topo.placement,
                                      num_experts=topo.num_experts)
                why += (f" (--ep {topo.ep} cuts experts {topo.world_size // topo.ep} ways; vLLM's expert parallel "
                        f"keeps them whole: ep = tp x dp)")
                fix = preflight_command(self.root, whole, node=sel.node, gpus_per_node=sel.gpus_per_node,
                                        ranks=ranks if self.ask.asks_ranks else None)
            else:
                fix = "give a --tp whose split every tensor allows (plan refuses the others, naming the tensor)"
            self.checks.append(Check("topology", FAIL, why, fix=fix))
            return None
        return {r: rt.total_bytes for r, rt in per_rank.items()}


def _issue(kind: str, file: str, message: str, tensor: str | None = None) -> Any:
    from ..integrity.verify import Issue

    return Issue(kind, file, message, tensor=tensor)


def _topology_json(topo: Topology | None) -> dict[str, Any] | None:
    return None if topo is None else {k: v for k, v in topo.to_json().items() if k != "experts_by_rank"}
