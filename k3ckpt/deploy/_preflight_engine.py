"""Preflight of a node directory for an engine launch (``--engine``): does the directory hold
exactly what that launch reads on this node, and which command line starts it.

The launch is vLLM's expert parallelism (``ep = tp x dp`` = the world size, never an expert cut),
so a rank reads every dense tensor and all tensors of its own experts; with
``--enable-ep-weight-filter`` it skips other ranks' experts by name. "Exactly" is our
:class:`~k3ckpt.format.topology.Topology` placement, which ``tests/test_engine_conformance.py``
proves equal to what vLLM's ``should_skip_weight`` keeps.

A launch *without* expert parallelism (``--no-expert-parallel``: vLLM without
``--enable-expert-parallel``) cuts every expert by TP, so every rank reads every expert: a
directory lacking any FAILs, with the launch it was written for as the fix. vLLM itself loads
such a directory without an error and answers wrong (``tests/test_engine_run.py``).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import CheckpointNotFoundError, LayoutError, PreflightError
from ..format.checkpoint import Checkpoint, open_checkpoint
from ..format.config import ModelConfig
from ..format.layout import NODE_LAYOUT_FORMAT, NODE_MARKER, TOPOLOGY_NAME, read_node_marker
from ..format.loadable import CONFIG_NAME
from ..format.roles import Kind, classify
from ..format.topology import Topology, TopologyError, ranks_of_node
from ..utils import format_ranges, load_json
from ._preflight_host import device_slots, disk_check, gpu_checks, memory_check, provenance_files, quant_check
from ._preflight_ranks import PlainCheckpoint, Request, _checkpoint_quant_counts
from ._preflight_report import (
    FAIL,
    PASS,
    WARN,
    Check,
    PreflightReport,
    copy_command,
    new_output_dir,
    node_fetch_command,
    node_reshard_command,
    preflight_command,
)
from .serve import serve_command


class EngineNodeDir(PlainCheckpoint):
    """A plain checkpoint directory (a ``reshard`` node directory, a rank-aware fetch, a full
    download) checked against one node of an engine launch."""

    def __init__(self, root: Path, ask: Request, engine: str, leader_address: str | None, rpc_port: int,
                 served_model_name: str | None, expert_parallel: bool = True, guard: bool = False) -> None:
        super().__init__(root, ask)
        self.engine = engine
        self.guard = guard  # the serve lines carry --load-format k3ckpt
        self.expert_parallel = expert_parallel
        self.leader = leader_address
        self.rpc_port = rpc_port
        self.served_model_name = served_model_name
        self.fetched_from: dict[str, Any] | None = None  # the hub a `fetch` recorded, set by run()

    def run(self) -> PreflightReport:
        ask = self.ask
        try:
            ckpt = open_checkpoint(self.root, jobs=ask.jobs, strict=False)
        except CheckpointNotFoundError as e:
            raise PreflightError(f"{self.root}: not a checkpoint directory ({e})") from None
        try:
            self.marker = read_node_marker(self.root)
        except LayoutError as e:
            raise PreflightError(str(e)) from None
        self.node_marker = (self.root / NODE_MARKER).is_file()
        # A hub download records where it came from (``fetch``'s source record); a reshard output
        # does not: that decides whether the fix is a fetch or a reshard.
        src = ckpt.source
        self.fetched_from = ({"hub": src.hub, "repo": src.repo, "revision": src.revision, "manifest": src.manifest}
                             if src.hub and src.repo else None)
        topo = self._launch(ckpt)
        per_node, node, how = self._node(topo)
        ranks = ranks_of_node(node, per_node, topo.world_size)
        self.checks.append(ask.check_environment(topo.world_size, ranks))
        self.checks.append(self._recorded(topo, node, per_node))
        if self.engine == "sglang":
            self.checks.append(self._sglang(topo, node, per_node))
        elif (placed := vllm_placement_check(ckpt.config, topo, self.expert_parallel)) is not None:
            if placed.status == FAIL:
                placed.fix = self._fix(Topology.make(topo.ep, topo.tp, topo.world_size, "linear",
                                                     num_experts=topo.num_experts), node, per_node)
            self.checks.append(placed)
        self.checks.append(self._structure(ckpt))
        self.checks += self._exact(ckpt, topo, node, per_node, ranks)
        need = self._rank_bytes(ckpt, topo, ranks)
        largest_file = max((h.file_size for h in ckpt.shards.values()), default=0)
        mx, fp8 = _checkpoint_quant_counts(ckpt)
        self.checks.append(disk_check(self.root, ask.min_free_disk, 0, ask.environ))
        self.checks.append(memory_check(largest_file, len(ranks), ask.environ))
        self.checks += gpu_checks(need, device_slots(ranks, per_node, ask.env), ask.kv_budget, ask.environ,
                                  mxfp4=mx > 0)
        self.checks.append(quant_check(ckpt.config, mx, fp8))
        self.checks += provenance_files(ckpt.root, {"repo": ckpt.source.repo, "revision": ckpt.source.revision},
                                        self._restorer(ckpt))
        serve = self._serve(topo, node, per_node)
        summary = {k: v for k, v in topo.to_json().items() if k != "experts_by_rank"}
        summary.update(dp=topo.dp, gpus_per_node=per_node, node=node, expert_parallel=self.expert_parallel)
        layout = "node-dir" if self.marker is not None else "checkpoint"  # a full download has no marker
        return PreflightReport(str(self.root), layout, summary, ranks, how, self.checks,
                               load_files=[ckpt.path_of(f) for f in sorted(ckpt.shards)],
                               node_bytes=sum(ckpt.tensors[n].nbytes for n in ckpt.tensors),
                               engine=self.engine, serve=serve, guarded=self.guard)

    def _serve(self, topo: Topology, node: int, per_node: int) -> list[str] | None:
        try:
            return serve_command(self.root, tp=topo.tp, dp=topo.dp, placement=topo.placement, node=node,
                                 gpus_per_node=per_node, leader_address=self.leader, rpc_port=self.rpc_port,
                                 served_model_name=self.served_model_name, engine=self.engine, guard=self.guard)
        except TopologyError as e:  # e.g. a TP group wider than a node: no command to print
            self.checks.append(Check("serve", FAIL, f"no {self.engine} command for this launch: {e}"))
            return None

    # -- the launch -------------------------------------------------------------------------------

    def _launch(self, ckpt: Checkpoint) -> Topology:
        """The launch's topology: the options in vLLM's reading (placement not given: the
        directory's), else the one the marker records."""
        sel = self.ask.selection
        recorded = self._recorded_topology()
        cfg = ckpt.config
        found = max((e for _, e in ckpt.stats.expert_parts), default=-1) + 1
        num_experts = ((cfg.num_experts if cfg and cfg.num_experts else 0)
                       or (recorded.num_experts if recorded else 0) or found or 1)
        if sel.names_topology:
            if sel.placement is None and recorded is not None:
                from dataclasses import replace

                sel = replace(sel, placement=recorded.placement)
            return sel.topology(num_experts, engine=True)
        if recorded is None:
            raise PreflightError(f"--engine {self.engine} needs the launch: --tp T --dp D (no {NODE_MARKER} "
                                 f"records one)")
        return recorded

    def _recorded_topology(self) -> Topology | None:
        t = (self.marker or {}).get("topology")
        if not isinstance(t, dict):
            return None
        try:
            return Topology(t.get("ep"), t.get("tp"), t.get("world_size"), t.get("expert_placement"),  # type: ignore[arg-type]
                            t.get("num_experts"))  # type: ignore[arg-type]
        except TopologyError:
            return None

    def _node(self, topo: Topology) -> tuple[int, int, str]:
        """(GPUs per node, this node, how it was chosen): the options, else the launcher's
        variables, else the marker's node."""
        ask, sel, env = self.ask, self.ask.selection, self.ask.env
        if ask.asks_ranks:
            raise PreflightError("--engine checks one node: give --node, not --ranks")
        marked = self.marker or {}
        per_node = sel.gpus_per_node or env.local_world_size or _int(marked.get("gpus_per_node")) or topo.world_size
        if sel.node is not None:
            ranks_of_node(sel.node, per_node, topo.world_size)  # out of range: exit 2, naming the option
            return per_node, sel.node, f"--node {sel.node} ({per_node} GPUs per node)"
        for value, var in ((env.node, env.sources.get("node")), (None if env.rank is None else env.rank // per_node,
                                                                  env.sources.get("rank"))):
            if value is not None and value * per_node < topo.world_size:
                return per_node, value, f"node {value} from {var} ({per_node} GPUs per node)"
        node = _int(marked.get("node"))
        if node is not None and node * per_node < topo.world_size:
            return per_node, node, f"node {node} from {self._marker_name()} ({per_node} GPUs per node)"
        return per_node, 0, f"node 0 ({per_node} GPUs per node)"

    def _marker_name(self) -> str:
        return NODE_MARKER if self.node_marker else "k3ckpt-partial.json"

    # -- checks -------------------------------------------------------------------------------------

    def _recorded(self, topo: Topology, node: int, per_node: int) -> Check:
        """The marker's topology and node against the launch."""
        name = "launch"
        desc = _describe(topo, node, per_node, self.expert_parallel)
        if self.marker is None:
            return Check(name, WARN, f"no {NODE_MARKER}: nothing records which launch this directory was written "
                                     f"for; checked by its contents against {desc}")
        rec = self._recorded_topology()
        m = self.marker
        have = {"--tp": rec.tp if rec else None, "--dp": rec.dp if rec else None,
                "--placement": rec.placement if rec else None, "--gpus-per-node": _int(m.get("gpus_per_node")),
                "--node": _int(m.get("node"))}
        want = {"--tp": topo.tp, "--dp": topo.dp, "--placement": topo.placement, "--gpus-per-node": per_node,
                "--node": node}
        if rec is not None and rec.ep != rec.world_size:
            return Check(name, FAIL, f"{self._marker_name()}: ep {rec.ep} below world size {rec.world_size} "
                                     f"(experts cut): no engine loads it", fix=self._fix(topo, node, per_node))
        # a rank-aware fetch without --node records no node: its ranks say which
        diff = [f"{k} {want[k]} ({self._marker_name()} has {v})" for k, v in have.items()
                if v is not None and v != want[k]]
        if m.get("node") is None and (ranks := m.get("ranks")) != ranks_of_node(node, per_node, topo.world_size):
            diff.append(f"ranks {format_ranges(ranks_of_node(node, per_node, topo.world_size))} "
                        f"({self._marker_name()} has {format_ranges(ranks) if isinstance(ranks, list) else ranks})")
        if diff:
            return Check(name, FAIL, f"{self.engine} launch is {desc}; the directory was written for another: "
                                     + ", ".join(diff), fix=self._fix(topo, node, per_node))
        if not self.expert_parallel:  # same tp, dp and node, but written for the launch with EP
            return Check(name, PASS, f"{self._marker_name()} was written for tp {topo.tp} x dp {topo.dp}, node {node} "
                                     f"of {per_node} GPUs, with expert parallelism; launched without it, every rank "
                                     f"reads every expert (experts, below)")
        return Check(name, PASS, f"{self._marker_name()} was written for this launch: {desc}")

    def _exact(self, ckpt: Checkpoint, topo: Topology, node: int, per_node: int, ranks: list[int]) -> list[Check]:
        """Every tensor each rank reads is present; no expert other nodes own is; every dense
        tensor the marker lists is present."""
        cfg = ckpt.config
        present: dict[int, dict[int, set[str]]] = {}  # layer -> expert -> tensor names, expert id as *
        dense = set()
        for n in ckpt.tensors:
            role = classify(n)
            if role.kind == Kind.ROUTED_EXPERT and role.expert is not None and role.layer is not None:
                present.setdefault(role.layer, {}).setdefault(role.expert, set()).add(
                    n.replace(f".experts.{role.expert}.", ".experts.*.", 1))
            else:
                dense.add(n)
        fix = self._fix(topo, node, per_node)
        layers = sorted(set(cfg.moe_layers) if cfg and cfg.moe_layers else set(present))
        shapes = {lay: set().union(*present.get(lay, {}).values()) for lay in layers}  # each expert's tensors
        lacking: dict[int, dict[int, int]] = {}  # rank -> expert -> first layer where it is incomplete
        for r in ranks:
            for e in self._experts_read(topo, r):
                bad = [lay for lay in layers if not shapes[lay] or shapes[lay] - present.get(lay, {}).get(e, set())]
                if bad:
                    lacking.setdefault(r, {})[e] = bad[0]
        needed = {e for r in ranks for e in self._experts_read(topo, r)}
        extra = sorted({e for lay in present for e in present[lay]} - needed)
        out = [self._dense_check(dense, cfg is not None)]
        if lacking:
            r = min(lacking)
            first = min(lacking[r])
            more = f" (+{len(lacking) - 1} more rank(s))" if len(lacking) > 1 else ""
            why = ""
            if not self.expert_parallel:  # the launch, not the directory, is what to change
                why = (f"; without expert parallelism every rank reads all {topo.num_experts} experts, cut by TP "
                       f"(vLLM loads the directory without an error and answers wrong)")
                fix = self._expert_parallel_launch() or fix
            out.append(Check("experts", FAIL, f"rank {r} lacks (all or some tensors of) experts "
                                              f"{format_ranges(sorted(lacking[r]))}, e.g. expert {first} in layer "
                                              f"{lacking[r][first]}{more}{why}", fix=fix,
                             details={"lacking": {str(k): format_ranges(sorted(v)) for k, v in lacking.items()}}))
        elif cfg is None:  # the layers come from the tensors present: a layer absent entirely goes unseen
            out.append(Check("experts", WARN, f"the {len(needed)} experts ranks {format_ranges(ranks)} read are in "
                                              f"each of the {len(layers)} layers holding experts; not checked "
                                              f"against {CONFIG_NAME} (missing or unreadable)",
                             details={"needed": format_ranges(sorted(needed))}))
        else:
            out.append(Check("experts", PASS, f"every tensor of the {len(needed)} experts ranks "
                                              f"{format_ranges(ranks)} read is present, in {len(layers)} MoE layers",
                             details={"needed": format_ranges(sorted(needed))}))
        if extra:
            what = (f"holds experts {format_ranges(extra)} that no rank of node {node} owns (vLLM's filter "
                    f"skips them, but")
            if self.marker is None:  # a full download: loadable, only larger than needed
                out.append(Check("exact", WARN, f"{what} they cost disk and the scales are read anyway)", fix=fix))
            else:
                out.append(Check("exact", FAIL, f"{what} the directory is not this node's)", fix=fix))
        else:
            out.append(Check("exact", PASS, f"no expert outside ranks {format_ranges(ranks)}"))
        return out

    def _experts_read(self, topo: Topology, rank: int) -> tuple[int, ...]:
        """The experts ``rank`` reads: its own under expert parallelism, else every one."""
        return topo.rank_info(rank).experts if self.expert_parallel else tuple(range(topo.num_experts))

    def _expert_parallel_launch(self) -> str | None:
        """The serve line of the expert-parallel launch the marker records, if it records one."""
        rec, m = self._recorded_topology(), self.marker or {}
        if rec is None or rec.world_size < 2:
            return None
        try:
            argv = serve_command(self.root, tp=rec.tp, dp=rec.dp, placement=rec.placement,
                                 node=_int(m.get("node")) or 0, gpus_per_node=_int(m.get("gpus_per_node")),
                                 leader_address=self.leader, rpc_port=self.rpc_port,
                                 served_model_name=self.served_model_name, engine=self.engine, guard=self.guard)
        except TopologyError:
            return None
        return shlex.join(argv)

    def _dense_check(self, dense: set[str], config_read: bool) -> Check:
        listed = (self.marker or {}).get("tensors")
        if not (self.node_marker and isinstance(listed, dict)):
            if not config_read:  # structure compares them with the config, which is unreadable
                return Check("dense", WARN, f"{len(dense)} non-expert tensors, not checked: no tensor list to "
                                            f"compare and {CONFIG_NAME} missing or unreadable")
            return Check("dense", PASS, f"{len(dense)} non-expert tensors (no tensor list to compare: "
                                        f"structure checks them against config.json)")
        want = {n for n in listed if classify(n).kind != Kind.ROUTED_EXPERT or classify(n).expert is None}
        missing = sorted(want - dense)
        if missing:
            return Check("dense", FAIL, f"{len(missing)} of {len(want)} non-expert tensors every rank reads are "
                                        f"absent: {missing[0]}" + (" ..." if len(missing) > 1 else ""),
                         fix=self._fix(None, None, None), details={"missing": missing})
        return Check("dense", PASS, f"all {len(want)} non-expert tensors {NODE_MARKER} lists are present")

    def _sglang(self, topo: Topology, node: int, per_node: int) -> Check:
        """:func:`sglang_check`; its fix, when the expert count divides: the linear node; else
        the check of the launch vLLM serves."""
        check = sglang_check(topo)
        if check.status == FAIL and topo.num_experts % topo.world_size == 0:
            linear = Topology.make(topo.ep, topo.tp, topo.world_size, "linear", num_experts=topo.num_experts)
            check.fix = self._fix(linear, node, per_node)
        elif check.status == FAIL:
            check.fix = preflight_command(self.root, topo, engine="vllm", node=node, gpus_per_node=per_node)
        return check

    def _structure_fix(self, ckpt: Checkpoint, issues: list[Any]) -> str:
        """A node's weight files are rewritten as the node (its index and marker with them); the
        other files restored as for any checkpoint."""
        if any(i.file is None or i.file in ckpt.shards or i.file.endswith(".safetensors") for i in issues):
            return self._fix(None, None, None)
        return super()._structure_fix(ckpt, issues)

    # -- the fix ------------------------------------------------------------------------------------

    def _fix(self, topo: Topology | None, node: int | None, per_node: int | None) -> str:
        """Write the node for the launch (``None``: the one already recorded). The directory's own
        launch is repaired in place - a fetched share by fetching it again, a reshard node by
        resharding it with ``--force``; any other launch (or a full download, which a node
        fetch would cut down) is written into a new directory: a fix never overwrites another
        topology's files, which other nodes may still load."""
        topo = topo or self._recorded_topology()
        marker = self.marker or {}
        node = node if node is not None else (_int(marker.get("node")) or 0)
        per_node = per_node or _int(marker.get("gpus_per_node")) or (topo.world_size if topo else 1)
        if topo is None:
            return node_reshard_command(None, new_output_dir(self.root.parent, "resharded"),
                                        Topology.make(1, 1, num_experts=1), node, per_node, force=False)
        own = self._is_recorded_launch(topo, node, per_node)
        suffix = f"tp{topo.tp}-dp{topo.dp}" + (f"-{topo.placement.replace('_', '-')}" if topo.placement != "linear" else "")
        source = marker.get("source") if isinstance(marker.get("source"), dict) else None
        if source is not None and self.fetched_from is not None:
            source = {**source, "manifest": self.fetched_from.get("manifest")}
        if not self.node_marker and source is not None:
            return node_fetch_command(source, self.root if own else new_output_dir(self.root, f"node{node}-{suffix}"),
                                      topo, node, per_node)
        if self.fetched_from is not None:  # a `fetch --node` directory, or a full download
            dest = self.root if own and self.marker is not None else new_output_dir(self.root, f"node{node}-{suffix}")
            return node_fetch_command(self.fetched_from, dest, topo, node, per_node)
        # reshard's output holds node directories of one topology: another node of it goes beside
        # this one (a complete one is skipped), another topology into a new output
        same = self._is_recorded_topology(topo, per_node)
        out = self.root.parent if same else new_output_dir(self.root.parent, suffix)
        return node_reshard_command(self._source_path(), out, topo, node, per_node, force=own)

    def _is_recorded_topology(self, topo: Topology, per_node: int) -> bool:
        """``topo`` with ``per_node`` GPUs per node is the topology the marker records."""
        rec, m = self._recorded_topology(), self.marker or {}
        return rec is not None and rec.to_json() == topo.to_json() and _int(m.get("gpus_per_node")) in (None, per_node)

    def _restorer(self, ckpt: Checkpoint) -> Callable[[list[str]], str | None]:
        """A reshard node's config, tokenizer and licence come from its source: copied back from
        there; a download's are fetched (``hf download`` in an HF cache)."""
        source = self._source_path()
        if self.fetched_from is None and source is not None:
            return lambda files: copy_command(source, files, ckpt.root)
        return super()._restorer(ckpt)

    def _is_recorded_launch(self, topo: Topology, node: int, per_node: int) -> bool:
        """``topo``, ``node`` and ``per_node`` are what the marker says the directory holds."""
        m = self.marker or {}
        if not self._is_recorded_topology(topo, per_node):
            return False
        if m.get("node") is not None:
            return _int(m.get("node")) == node
        return m.get("ranks") == ranks_of_node(node, per_node, topo.world_size)

    def _source_path(self) -> str | None:
        """The source ``reshard`` recorded in its output's ``topology.json``."""
        path = self.root.parent / TOPOLOGY_NAME
        if not path.is_file():
            return None
        try:
            tj, _ = load_json(path, PreflightError)
        except PreflightError:
            return None
        if not isinstance(tj, dict) or tj.get("format") != NODE_LAYOUT_FORMAT or not isinstance(tj.get("source"), dict):
            return None
        src = tj["source"].get("path")
        return src if isinstance(src, str) else None


def vllm_placement_check(cfg: ModelConfig | None, topo: Topology, expert_parallel: bool = True) -> Check | None:
    """vLLM 0.32.0 and 0.33.0 place experts round_robin only for a model with several expert
    groups (``determine_expert_placement_strategy``); with one, its MoE layers fall back to
    linear while the EP weight filter keeps round_robin's experts, so all but about 1 in ep of
    each rank's local expert slots are never loaded (half at ep 2) - silently
    (``tests/test_engine_run.py`` pins it). None when the launch is not round_robin expert
    parallelism."""
    if topo.placement != "round_robin" or topo.world_size < 2 or not expert_parallel or cfg is None:
        return None
    if cfg.expert_groups > 1:
        key = cfg.expert_groups_entry[0]
        return Check("placement", PASS, f"round_robin with {cfg.expert_groups} expert groups ({CONFIG_NAME} {key}): "
                                        f"vLLM places experts as the directory does")
    has = cfg.describe_expert_groups()
    return Check("placement", FAIL, f"round_robin, but {CONFIG_NAME} has {has}: vLLM then places experts linearly "
                                    f"(\"Falling back to linear expert placement\") while its weight filter keeps "
                                    f"round_robin's, so all but about 1 in ep of each rank's expert slots are never "
                                    f"loaded, with no error; write the node for linear placement")


def sglang_check(topo: Topology) -> Check:
    """SGLang 0.5.23 places experts in contiguous equal blocks and asserts the count divides
    (docs/engines.md): anything else fails when the model is built, so it is a FAIL here."""
    problems = []
    if topo.placement != "linear":
        problems.append(f"{topo.placement} placement (SGLang places experts linearly only)")
    if topo.num_experts % topo.world_size:
        problems.append(f"{topo.num_experts} experts do not divide by ep {topo.world_size} (SGLang asserts "
                        f"num_experts % ep_size == 0)")
    if problems:
        return Check("sglang", FAIL, "SGLang cannot load this launch: " + "; ".join(problems)
                     + "; serve it with vLLM (--engine vllm), or write it for linear placement over an ep "
                       "that divides the experts")
    return Check("sglang", PASS, f"linear placement, {topo.num_experts} experts over ep {topo.world_size}: "
                                 f"--tp-size {topo.world_size} --ep-size {topo.world_size}")


def _describe(topo: Topology, node: int, per_node: int, expert_parallel: bool = True) -> str:
    if not expert_parallel:
        return (f"tp {topo.tp} x dp {topo.dp} without expert parallelism, {topo.num_experts} experts, node {node} "
                f"of {per_node} GPUs")
    return (f"tp {topo.tp} x dp {topo.dp} = ep {topo.world_size}, {topo.num_experts} experts {topo.placement}, "
            f"node {node} of {per_node} GPUs")


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None
