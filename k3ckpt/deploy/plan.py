"""``k3ckpt plan``: what each rank of a TP/EP topology holds, and which accelerators fit it.

Works from a local checkpoint or from a manifest (``manifest pull`` makes one from hub metadata
alone), so a deployment can be planned before anything is downloaded. The per-rank contents
follow the layout contract (:mod:`k3ckpt.format.topology`). With ``layout="node"`` (the
default, as for ``reshard``) the topology has vLLM's expert-parallel reading and the plan adds
what each node directory holds on disk: every dense tensor whole plus the node's experts.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..format.checkpoint import Checkpoint, open_checkpoint
from ..format.config import ModelConfig
from ..format.header import TensorInfo
from ..format.layout import LAYOUT_ALIASES, LAYOUTS
from ..format.roles import classify
from ..format.topology import (
    InventoryIndex,
    RankSelection,
    Topology,
    TopologyError,
    check_heads,
    index_of,
    num_nodes,
    ranks_of_node,
    tensors_for_ranks,
)
from ._memory import DEFAULT_KV_BUDGET, WEIGHT_OVERHEAD, loaded_bytes
from .estimate import MEASURED_COSTS, CostPerGB, Limits, NodeBytes, ReadyEstimate, estimate_ready, render_ready

#: Accelerators and their memory (nominal HBM capacity, decimal bytes, as vendors quote it).
ACCELERATORS: dict[str, int] = {
    "H100 80 GB": 80 * 10**9,
    "H200 141 GB": 141 * 10**9,
    "B200 192 GB": 192 * 10**9,
    "GB300 288 GB": 288 * 10**9,
    "MI355X 288 GB": 288 * 10**9,
}


@dataclass
class RankPlan:
    rank: int
    node: int | None
    ep_rank: int
    tp_rank: int
    moe_tp_rank: int
    experts: int
    first_expert: int | None
    last_expert: int | None
    routed_bytes: int
    split_bytes: int
    replicated_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.routed_bytes + self.split_bytes + self.replicated_bytes


@dataclass
class PlanReport:
    source: str
    topology: dict[str, Any]
    ranks: list[RankPlan]
    kv_budget: int
    checkpoint_bytes: int
    notes: list[str] = field(default_factory=list)
    layout: str = "node"
    nodes: list[NodeBytes] = field(default_factory=list)  # with layout "node"
    ready: ReadyEstimate | None = None  # with limits: the time to ready of every node

    @property
    def largest(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.total_bytes)

    def need_per_gpu(self, rank: RankPlan | None = None) -> int:
        """Weights x 1.15 + the KV budget, for ``rank`` (default: the largest)."""
        r = rank or self.largest
        return loaded_bytes(r.total_bytes) + self.kv_budget

    def fits(self) -> dict[str, bool]:
        need = self.need_per_gpu()
        return {name: need <= mem for name, mem in ACCELERATORS.items()}

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source, "topology": self.topology, "kv_budget": self.kv_budget,
            "checkpoint_bytes": self.checkpoint_bytes,
            "ranks": [{**asdict(r), "total_bytes": r.total_bytes, "need_bytes": self.need_per_gpu(r)} for r in self.ranks],
            "largest_rank": self.largest.rank, "need_per_gpu_bytes": self.need_per_gpu(),
            "weight_overhead": WEIGHT_OVERHEAD, "fits": self.fits(), "notes": self.notes, "format": self.layout,
            "nodes": [{**asdict(n), "total_bytes": n.total_bytes} for n in self.nodes],
            **({"time_to_ready": self.ready.to_json()} if self.ready is not None else {}),
        }


def _from_manifest(path: Path) -> tuple[dict[str, TensorInfo], int]:
    from ..integrity.manifest import Manifest

    m = Manifest.load(path)
    tensors = {n: TensorInfo(n, t.dtype, t.shape, t.offsets[0], t.offsets[1], t.file) for n, t in m.tensors.items()}
    return tensors, m.total_bytes


def plan_topology(
    source: str | os.PathLike[str] | Checkpoint,
    selection: RankSelection = RankSelection(),
    *,
    kv_budget: int = DEFAULT_KV_BUDGET,
    jobs: int | None = None,
    layout: str = "node",
    limits: Limits | None = None,
    costs: CostPerGB = MEASURED_COSTS,
) -> PlanReport:
    """Plan ``selection``'s ep x tp over a checkpoint directory or a manifest file: every rank,
    grouped into nodes of ``selection.gpus_per_node``. ``layout``: ``node`` (vLLM's expert
    parallel reading of the options, :meth:`RankSelection.topology`; adds each node
    directory's bytes, one node of the whole world without ``gpus_per_node``) or ``rank``.
    ``limits``: each node's link, disk and cores; the report then adds every node's time to
    ready by three routes, from ``costs`` (:mod:`k3ckpt.deploy.estimate`; node layout only).

    Raises:
        TopologyError / SplitError: the topology is impossible, with the precise reason, or
            ``selection`` names ranks or a node (a plan covers every rank).
    """
    if selection.ranks is not None or selection.node is not None:
        raise TopologyError("a plan covers every rank: give no ranks or node")
    notes: list[str] = []
    cfg: ModelConfig | None = None
    if isinstance(source, Checkpoint):
        ckpt: Checkpoint | None = source
    elif Path(source).is_file():
        ckpt = None
    else:
        ckpt = open_checkpoint(source, jobs=jobs)
    if ckpt is not None:
        cfg = ckpt.config
        tensors: dict[str, TensorInfo] = ckpt.tensors
        idx = index_of(ckpt)
        total = ckpt.total_bytes
        label = str(ckpt.root)
    else:
        assert not isinstance(source, Checkpoint)  # a Checkpoint source always sets ckpt
        tensors, total = _from_manifest(Path(source))
        idx = index_of((tensors, {n: classify(n) for n in tensors}))
        label = str(source)
        notes.append("planned from a manifest: expert count inferred from tensor names")
    layout = LAYOUT_ALIASES.get(layout, layout)
    if layout not in LAYOUTS:
        raise TopologyError(f"unknown --format {layout!r}; choose {' or '.join(LAYOUTS)}")
    if limits is not None and layout != "node":
        raise TopologyError("the time to ready (--link, --disk, --cores) is estimated for the node format's "
                            "routes: drop --format rank")
    # the rules every writer applies (plan says before a byte is written what reshard and fetch
    # --node would refuse): experts the config does not count, nodes the engine cannot launch
    topo = selection.topology_for(idx, cfg, engine=layout == "node")
    check_heads(cfg, topo.tp, notes) if ckpt is not None else notes.append(
        "no config.json in a manifest: attention-head divisibility by --tp was not checked")
    per_rank = tensors_for_ranks(idx, topo, gpus_per_node=selection.gpus_per_node)
    ranks = []
    for r, rt in sorted(per_rank.items()):
        info = rt.rank
        ex = info.experts
        ranks.append(RankPlan(
            rank=r, node=info.node, ep_rank=info.ep_rank, tp_rank=info.tp_rank, moe_tp_rank=info.moe_tp_rank,
            experts=len(ex), first_expert=min(ex) if ex else None, last_expert=max(ex) if ex else None,
            routed_bytes=rt.routed_bytes, split_bytes=rt.split_bytes, replicated_bytes=rt.replicated_bytes,
        ))
    if not tensors:
        raise TopologyError(f"{label}: no tensors to plan")
    gpus_per_node = selection.gpus_per_node
    nodes: list[NodeBytes] = []
    if layout == "node":
        gpus_per_node = gpus_per_node or topo.world_size
        nodes = node_bytes(idx, topo, gpus_per_node)
    ready = estimate_ready(idx, topo, nodes, total, limits, costs) if limits is not None else None
    topo_json = {**topo.to_json(), "moe_tp": topo.moe_tp, "dp": topo.dp, "gpus_per_node": gpus_per_node}
    return PlanReport(label, topo_json, ranks, kv_budget, total, notes, layout, nodes, ready)


def node_bytes(idx: InventoryIndex, topo: Topology, gpus_per_node: int) -> list[NodeBytes]:
    """Each node directory's bytes (tensor data; headers add a few KB a file), from the
    inventory's signatures alone: the same sums a node's files add up to."""
    size = [s.nbytes for s in idx.sigs]
    dense = sum(map(size.__getitem__, idx.dense_sigs))
    per_expert = {e: sum(n * size[s] for s, n in c.items()) for e, c in idx.expert_counts.items()}
    out = []
    for n in range(num_nodes(gpus_per_node, topo.world_size)):
        ranks = ranks_of_node(n, gpus_per_node, topo.world_size)
        experts = {e for r in ranks for e in topo.rank_info(r).experts}
        out.append(NodeBytes(n, ranks, len(experts), dense, sum(per_expert.get(e, 0) for e in experts)))
    return out


def render_plan(rep: PlanReport) -> str:
    from ..utils import human_bytes

    t = rep.topology
    lines = [
        f"plan      {rep.source} ({human_bytes(rep.checkpoint_bytes)})",
        f"topology  ep {t['ep']} x tp {t['tp']}, world size {t['world_size']} (moe_tp {t['moe_tp']}, dp {t['dp']}), "
        f"placement {t['expert_placement']}, {t['num_experts']} experts"
        + (f", {t['gpus_per_node']} GPUs per node" if t.get("gpus_per_node") else ""),
        "",
        f"{'rank':>4} {'node':>4} {'ep':>3} {'tp':>3} {'mtp':>3} {'experts':>16} {'routed':>11} {'tp-split':>11} "
        f"{'replicated':>11} {'total':>11}",
    ]
    for r in rep.ranks:
        ex = f"{r.experts} [{r.first_expert}-{r.last_expert}]" if r.experts else "0"
        node = "-" if r.node is None else str(r.node)
        lines.append(f"{r.rank:>4} {node:>4} {r.ep_rank:>3} {r.tp_rank:>3} {r.moe_tp_rank:>3} {ex:>16} "
                     f"{human_bytes(r.routed_bytes):>11} {human_bytes(r.split_bytes):>11} "
                     f"{human_bytes(r.replicated_bytes):>11} {human_bytes(r.total_bytes):>11}")
    big = rep.largest
    need = rep.need_per_gpu()
    lines += [
        "",
        f"largest   rank {big.rank}: {human_bytes(big.total_bytes)} of weights; per GPU need "
        f"{human_bytes(big.total_bytes)} x {WEIGHT_OVERHEAD} + {human_bytes(rep.kv_budget)} KV = {human_bytes(need)}",
        "fits      " + ", ".join(f"{name} {'yes' if ok else 'no'}" for name, ok in rep.fits().items()),
    ]
    if rep.nodes:
        lines += ["", f"{'node':>4} {'ranks':>9} {'experts':>8} {'dense':>11} {'experts':>11} {'on disk':>11}"]
        for n in rep.nodes:
            span = f"{n.ranks[0]}-{n.ranks[-1]}" if len(n.ranks) > 1 else str(n.ranks[0])
            lines.append(f"{n.node:>4} {span:>9} {n.experts:>8} {human_bytes(n.dense_bytes):>11} "
                         f"{human_bytes(n.expert_bytes):>11} {human_bytes(n.total_bytes):>11}")
    if rep.ready is not None:
        lines += ["", *render_ready(rep.ready)]
    lines += [f"note      {n}" for n in rep.notes]
    return "\n".join(lines)
