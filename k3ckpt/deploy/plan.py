"""``k3ckpt plan``: what each rank of a TP/EP topology holds, and which accelerators fit it.

Works from a local checkpoint or from a manifest (``manifest pull`` makes one from hub metadata
alone), so a deployment can be planned before anything is downloaded. The per-rank contents
follow the rank-layout contract (:mod:`k3ckpt.topology`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..format.checkpoint import Checkpoint, open_checkpoint
from ..format.config import ModelConfig
from ..format.header import TensorInfo
from ..format.roles import classify
from ..format.topology import RankSelection, TopologyError, check_heads, index_of, num_experts_of, tensors_for_ranks

#: Rule of thumb for what a rank needs beyond its weights (activations, CUDA graphs, buffers).
WEIGHT_OVERHEAD = 1.15
DEFAULT_KV_BUDGET = 20 * 1024**3

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

    @property
    def largest(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.total_bytes)

    def need_per_gpu(self, rank: RankPlan | None = None) -> int:
        """Weights x 1.15 + the KV budget, for ``rank`` (default: the largest)."""
        r = rank or self.largest
        return int(r.total_bytes * WEIGHT_OVERHEAD) + self.kv_budget

    def fits(self) -> dict[str, bool]:
        need = self.need_per_gpu()
        return {name: need <= mem for name, mem in ACCELERATORS.items()}

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source, "topology": self.topology, "kv_budget": self.kv_budget,
            "checkpoint_bytes": self.checkpoint_bytes,
            "ranks": [{**asdict(r), "total_bytes": r.total_bytes, "need_bytes": self.need_per_gpu(r)} for r in self.ranks],
            "largest_rank": self.largest.rank, "need_per_gpu_bytes": self.need_per_gpu(),
            "weight_overhead": WEIGHT_OVERHEAD, "fits": self.fits(), "notes": self.notes,
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
) -> PlanReport:
    """Plan ``selection``'s ep x tp over a checkpoint directory or a manifest file: every rank,
    grouped into nodes of ``selection.gpus_per_node``.

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
    topo = selection.topology(num_experts_of(idx, cfg.num_experts if cfg else None))
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
    topo_json = {**topo.to_json(), "moe_tp": topo.moe_tp, "dp": topo.dp,
                 "gpus_per_node": selection.gpus_per_node}
    return PlanReport(label, topo_json, ranks, kv_budget, total, notes)


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
    lines += [f"note      {n}" for n in rep.notes]
    return "\n".join(lines)
